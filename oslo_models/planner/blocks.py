"""Per-block plans (OSDP / Galvatron): for one data-parallel layout, choose per transformer block whether it is
sharded or replicated, resharded after forward, checkpointed, minimizing the predicted step time under the cap.

The cost model (``block_costs``; every byte counted per tensor as in ``memory.py``, on dp rank 0, which holds the
largest ``torch.chunk`` piece):

- root (embeddings, final norm, head): sharded over dp (parameters, gradients, AdamW state ``1/dp``), its
  gathered parameters held through the step (``buffers``); its all-gather once per microbatch, its reduce-scatter
  once per microbatch, exposed (nothing to hide them behind at the ends of the pass);
- a block, per choice (``BLOCK_OPTIONS``):

  =============  ====================================  =========================================================
  choice         memory (additive)                     data-parallel traffic per microbatch
  =============  ====================================  =========================================================
  ``R``          whole parameters, gradients, state    all-reduce of its gradients
  ``s``          ``1/dp`` state + its gathered          all-gather (forward) + reduce-scatter
                 parameters from forward to backward
  ``S``          ``1/dp`` state                        2 all-gathers (forward, backward) + reduce-scatter
  ``+c``         its input instead of its activations  (compute: one more forward of the block)
  =============  ====================================  =========================================================

  a block's traffic overlaps its own forward + backward compute (FSDP2 prefetches the next block's gather while
  this one computes): exposed ``max(0, traffic - overlap x compute)`` per microbatch (``Hardware.overlap``: 1 by
  default, 0 for gloo on a CPU box whose cores run both);
- transients: while a resharded block runs, it and the prefetched next one are gathered (``2 x`` the largest
  block's parameters, when any block is ``S``); while a checkpointed block is recomputed, one block's activations
  (when any block is ``+c``).

So memory is additive over blocks plus transients that depend only on *whether* any block is resharded or
checkpointed. ``best_plan`` is exact: for each of those four cases it solves the multiple-choice knapsack
(minimum time, memory at most the cap) by dynamic programming over the blocks on Pareto fronts of
``(memory, time)`` pairs (numpy; equal or dominated pairs dropped), and keeps the best case. ``brute_force_plan``
tries every plan (``6 ** blocks``); the tests check that the two agree.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..block_plan import BlockChoice
from .facts import ModelFacts
from .memory import MOMENTS, STEP_BYTES, MemoryEstimate, _chunk_rows, _numel
from .time import Hardware, TimeEstimate, all_gather, all_reduce

# every choice a block has: (shard, reshard_after_forward, checkpoint)
BLOCK_OPTIONS = tuple(BlockChoice(shard, reshard, ckpt) for shard, reshard in ((True, True), (True, False),
                                                                              (False, False))
                      for ckpt in (False, True))


@dataclass
class BlockCosts:
    """The per-block cost model of one layout (see the module docstring). Per block ``i`` and option ``j``:
    ``memory[i, j]`` bytes and ``time[i, j]`` seconds, additive; the rest is fixed or transient."""

    memory: np.ndarray  # [blocks, options] bytes
    time: np.ndarray  # [blocks, options] seconds
    state: np.ndarray  # [blocks, options, 3] parameters, gradients, optimizer bytes (the state part of memory)
    gathered: np.ndarray  # [blocks] a block's whole (gathered) local parameter bytes
    root_state: tuple  # (parameters, gradients, optimizer) bytes
    root_buffers: int  # the root's gathered parameters
    fixed_activations: int  # outside the blocks (embeddings, logits)
    gather_transient: int  # 2 x the largest block's gathered parameters
    recompute_transient: int  # one block's activations
    base_time: TimeEstimate  # compute outside the blocks' options, tensor-parallel traffic, root traffic

    @property
    def blocks(self) -> int:
        return self.memory.shape[0]


def _block_prefixes(facts: ModelFacts) -> list[str]:
    """Module paths of the model's FSDP units (``training.zero.fsdp_units``), in module order."""
    from ..training.zero import fsdp_units

    model, _ = facts._whole()
    units = {id(module) for module in fsdp_units(model)}
    return [name + "." for name, module in model.named_modules() if id(module) in units]


def _block_bytes(facts: ModelFacts, tp: int, dp: int) -> tuple[np.ndarray, ...]:
    """Per block (root last): whole local bytes, dp rank 0's chunk bytes, tensor count, full element count
    (cached in ``facts.cache`` per ``(tp, dp)``)."""
    key = ("block bytes", tp, dp)
    if key in facts.cache:
        return facts.cache[key]
    if "block owners" not in facts.cache:
        prefixes = _block_prefixes(facts)
        owners = []
        for p in facts.parameters():
            owners.append(next((i for i, prefix in enumerate(prefixes) if p.name.startswith(prefix)), len(prefixes)))
        facts.cache["block owners"] = (len(prefixes), owners)
    blocks, owners = facts.cache["block owners"]
    full, shard, tensors, numels = (np.zeros(blocks + 1) for _ in range(4))
    for p, i in zip(facts.parameters(), owners):
        shape = p.local_shape(tp=tp)
        full[i] += _numel(shape) * p.element_size
        shard[i] += (_chunk_rows(shape[0], dp, 0) * _numel(shape[1:]) if shape else 1) * p.element_size
        tensors[i] += 1
        numels[i] += _numel(p.full_shape)
    facts.cache[key] = (full, shard, tensors, numels)
    return facts.cache[key]


def block_costs(facts: ModelFacts, world_size: int, hardware: Hardware, *, tensor_parallel_size: int = 1,
                sequence_parallel: bool = False, global_batch: int, seq_len: int, micro_batch: int,
                mixed_precision: str = "no") -> BlockCosts:
    """The cost model of every block choice for ``tp x dp`` (``dp = world_size / tp``; no pp, cp, ep). Compute:
    FLOPs at ``hardware.matmul_flops``, or, with ``hardware.profile`` (``profile.py``), the real block's measured
    forward + backward (``"full"`` checkpointing's for a checkpointed block; each block scaled by its parameter count
    over the median block's) and the embedding/head's, as ``time.estimate_time`` does."""
    tp, dp = tensor_parallel_size, world_size // tensor_parallel_size
    sp = sequence_parallel and tp > 1
    steps = global_batch // dp // micro_batch  # gradient-accumulation microbatches
    element = 2 if mixed_precision in ("bf16", "fp16") else facts.parameters()[0].element_size
    full, shard, tensors, numels = _block_bytes(facts, tp, dp)
    link = hardware.link(dp * tp)
    tokens = micro_batch * seq_len
    per_layer = facts.activation_bytes_per_token_per_layer(seq_len, tp=tp, sequence_parallel=sp,
                                                           element_size=element) * tokens
    block_input = element * facts.hidden_size * tokens / (tp if sp else 1)
    attention = 2 * 2 * seq_len * facts.hidden_size / 2  # per block per token, forward
    blocks = len(full) - 1
    memory = np.zeros((blocks, len(BLOCK_OPTIONS)))
    time = np.zeros((blocks, len(BLOCK_OPTIONS)))
    state = np.zeros((blocks, len(BLOCK_OPTIONS), 3))
    profile = hardware.profile
    typical = float(np.median(numels[:-1])) if blocks else 1.0
    for i in range(blocks):
        forward = (2 * numels[i] + attention) * tokens / tp / hardware.matmul_flops  # one microbatch
        if profile is not None:  # the real block timed at these shapes (profile.py), scaled by this block's size
            measured = {ckpt: profile.block(tp, seq_len, micro_batch, "full" if ckpt else None) * numels[i] / typical
                        for ckpt in (False, True)}
        for j, choice in enumerate(BLOCK_OPTIONS):
            held = shard[i] if choice.shard else full[i]
            state[i, j] = (held, held, MOMENTS * held + STEP_BYTES * tensors[i])
            memory[i, j] = state[i, j].sum() + (full[i] if choice.shard and not choice.reshard_after_forward
                                                else 0) + (block_input if choice.checkpoint else per_layer)
            compute = forward * (4 if choice.checkpoint else 3) if profile is None else measured[choice.checkpoint]
            if choice.shard:
                traffic = (3 if choice.reshard_after_forward else 2) * all_gather(full[i], dp, link)
            else:
                traffic = all_reduce(full[i], dp, link)
            time[i, j] = steps * (compute + max(0.0, traffic - hardware.overlap * compute))
    root_forward = (2 * numels[-1] * tokens / tp / hardware.matmul_flops if profile is None
                    else profile.outside(tp, seq_len, micro_batch) / 3)  # forward + backward = 3 forwards
    comm = {"dp": steps * 2 * all_gather(full[-1], dp, link)}
    if tp > 1:  # as estimate_time: 2 all-reduces forward + 2 backward per block
        comm["tp"] = steps * blocks * 4 * all_reduce(tokens * facts.hidden_size * element, tp, hardware.link(tp))
    outside = facts.outside_layers_bytes_per_token(tp=tp, sequence_parallel=sp, element_size=element) * tokens
    root_state = (shard[-1], shard[-1], MOMENTS * shard[-1] + STEP_BYTES * tensors[-1])
    gather = int(2 * full[:-1].max()) if blocks else 0
    return BlockCosts(memory, time, state, full[:-1].copy(), root_state, int(full[-1]), int(outside), gather,
                      int(per_layer), TimeEstimate(steps * 3 * root_forward, comm))


def _transients(costs: BlockCosts, resharded: bool, checkpointed: bool) -> int:
    return (costs.gather_transient if resharded else 0) + (costs.recompute_transient if checkpointed else 0)


def evaluate_plan(costs: BlockCosts, plan) -> tuple[MemoryEstimate, TimeEstimate]:
    """Predicted memory and time of ``plan`` (a sequence of ``BlockChoice``)."""
    index = [BLOCK_OPTIONS.index(choice) for choice in plan]
    rows = np.arange(costs.blocks)
    state = costs.state[rows, index].sum(axis=0) + np.array(costs.root_state)
    kept = sum(g for g, c in zip(costs.gathered, plan) if c.shard and not c.reshard_after_forward)
    buffers = costs.root_buffers + kept + _transients(costs, any(c.shard and c.reshard_after_forward for c in plan),
                                                      any(c.checkpoint for c in plan))
    activations = costs.memory[rows, index].sum() - costs.state[rows, index].sum() - kept + costs.fixed_activations
    memory = MemoryEstimate(int(state[0]), int(state[1]), int(state[2]), int(round(activations)), int(buffers))
    base = costs.base_time
    block_time = float(costs.time[rows, index].sum())
    return memory, TimeEstimate(base.compute + block_time, dict(base.communication))


def _fixed_memory(costs: BlockCosts) -> int:
    return int(sum(costs.root_state)) + costs.root_buffers + costs.fixed_activations


def best_plan(costs: BlockCosts, memory_cap: float) -> tuple[BlockChoice, ...] | None:
    """The fastest plan whose predicted memory is at most ``memory_cap`` (exact; ``None`` when none fits). Ties:
    the least memory, then the first found."""
    best = None
    for resharded, checkpointed in itertools.product((False, True), repeat=2):
        allowed = [j for j, c in enumerate(BLOCK_OPTIONS) if (resharded or not (c.shard and c.reshard_after_forward))
                   and (checkpointed or not c.checkpoint)]
        budget = memory_cap - _fixed_memory(costs) - _transients(costs, resharded, checkpointed)
        found = _knapsack(costs.memory[:, allowed], costs.time[:, allowed], budget)
        if found is None:
            continue
        plan = tuple(BLOCK_OPTIONS[allowed[j]] for j in found)
        memory, time = evaluate_plan(costs, plan)
        key = (time.total, memory.total)
        if best is None or key < best[0]:
            best = (key, plan)
    return None if best is None else best[1]


def _knapsack(memory: np.ndarray, time: np.ndarray, budget: float) -> list[int] | None:
    """Option index per row minimizing the summed time with summed memory <= ``budget``: the Pareto front of
    ``(memory, time)`` over the rows so far, extended one row at a time, with back-pointers."""
    front_m, front_t = np.zeros(1), np.zeros(1)
    parents: list[tuple[np.ndarray, np.ndarray]] = []
    for m_row, t_row in zip(memory, time):
        k = len(m_row)
        m = (front_m[:, None] + m_row[None, :]).ravel()
        t = (front_t[:, None] + t_row[None, :]).ravel()
        parent, option = np.repeat(np.arange(len(front_m)), k), np.tile(np.arange(k), len(front_m))
        keep = m <= budget + 1e-6
        if not keep.any():
            return None
        m, t, parent, option = m[keep], t[keep], parent[keep], option[keep]
        order = np.lexsort((t, m))  # by memory, then time
        m, t, parent, option = m[order], t[order], parent[order], option[order]
        # Pareto: keep a point only if it is strictly faster than every point with less or equal memory
        previous = np.concatenate(([np.inf], np.minimum.accumulate(t)[:-1]))
        pareto = t < previous * (1 - 1e-12) - 1e-15
        front_m, front_t = m[pareto], t[pareto]
        parents.append((parent[pareto], option[pareto]))
    index = int(np.argmin(front_t))  # the fastest; the front is sorted by memory, so the least memory among ties
    plan = []
    for parent, option in reversed(parents):
        plan.append(int(option[index]))
        index = int(parent[index])
    return plan[::-1]


def brute_force_plan(costs: BlockCosts, memory_cap: float) -> tuple[BlockChoice, ...] | None:
    """Every plan (``6 ** blocks``), evaluated in full: the reference ``best_plan`` is tested against."""
    best = None
    for plan in itertools.product(BLOCK_OPTIONS, repeat=costs.blocks):
        memory, time = evaluate_plan(costs, plan)
        if memory.total <= memory_cap:
            key = (time.total, memory.total)
            if best is None or key < best[0]:
                best = (key, plan)
    return None if best is None else best[1]
