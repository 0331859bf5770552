"""Per-rank memory of a layout: parameters, gradients, optimizer state (exact), activations and buffers (model).

The training state (parameters + gradients + AdamW state) is *counted*, tensor by tensor, the way the project's
wrappers place it (``training/zero.py``), so the prediction equals what a rank holds after an optimizer step
(tests/planner/test_memory_measured.py compares them byte for byte):

- tensor/expert parallelism: each parameter's local shape is its plan layout's ``local_shape`` (``facts.py``);
  pipeline parallelism: only the rank's stages' parameters (tied copies on both ends counted on both);
- ZeRO-0 (DDP): every local parameter, its gradient and its AdamW state (``exp_avg``, ``exp_avg_sq`` in the
  parameter's dtype, plus a 4-byte fp32 ``step`` per tensor, torch's default);
- ZeRO-1 (``ZeroRedundancyOptimizer`` over dp x cp, experts over edp): whole tensors are assigned to ranks by
  torch's own greedy rule (largest first, to the rank with the fewest elements so far); a rank keeps optimizer
  state only for its tensors;
- ZeRO-2/3 (FSDP2 over dp x cp, HSDP over ``data_parallel_shard_size``, experts over edp): each local tensor's
  dim 0 is cut like ``torch.chunk`` (``ceil(n/k)`` rows per rank, the last ones shorter or empty); parameters,
  gradients and state are all sharded (at rest: stage 2 keeps the gathered parameters during the step, counted in
  ``buffers``);
- CPU offload: the sharded parameters, gradients and state live in host memory (``host``), not on the device.
- NVMe offload (``ParallelConfig.offload="nvme"``, ``training/nvme_offload.py``; ZeRO 0/2/3): the AdamW moments of
  the rank's local shards are in its scratch file (``disk``); the ``step`` counters and the step's two chunk
  buffers (the chunk updated; the one written back, then prefetched) in host memory (``host``). With
  ``offload_params=True`` (ZeRO-3, ``training/nvme_params.py``) the parameter shards are on disk too (the gathered
  units stay in ``buffers``).

Bf16 autocast (Accelerate's ``mixed_precision="bf16"``) keeps fp32 parameters, so there is no separate master
copy; a model loaded in bf16 keeps bf16 parameters, gradients and AdamW moments (torch's ``zeros_like``).

Activations are a model (``ModelFacts.activation_bytes_per_token_per_layer``) times the tokens a rank holds:
``micro_batch x seq / cp`` per microbatch, times the microbatches in flight on the busiest pipeline rank (1F1B and
zero-bubble: ``pp``; GPipe: all of them; interleaved: ``pp + (pp - 1) / v`` chunk-microbatches' worth), with
checkpointing keeping only each block's input (``full``; ``partitioned``: ``1/tp`` of it; ``offload``: none on
the device); the block being recomputed in backward is counted in ``buffers``. Measured against the saved-tensor
hooks of the tiny Llama: within 10% single-process for each checkpointing mode (tests/planner/test_planner.py) and
on every rank at tp2, tp2 + sp (with and without full checkpointing), cp2 and tp2 x sp x cp2
(tests/planner/test_memory_measured.py); pipeline ranks' in-flight peaks are not measured.

Long sequences (issue 52): ``ParallelConfig.tiled_mlp`` removes the feed-forward's inside (``4f`` gated per token)
from what a block keeps and adds one slice of it, recomputed in the backward, to ``buffers``; the tiled loss
(``estimate_memory(..., tiled_loss=True)``: the heads' ``skip_logits=True``) replaces the fp32 logits by the hidden
states' gradient plus a ``[V / tp, h]`` fp32 weight-gradient accumulator; ``ParallelConfig.activation_offload``
moves the blocks' share to ``host``. Each within 10% of the saved-tensor hooks (tests/planner/
test_long_sequence_memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ParallelConfig
from .facts import ModelFacts, ParamFact

STEP_BYTES = 4  # AdamW's per-tensor ``step`` (a float32 scalar tensor)
MOMENTS = 2  # exp_avg, exp_avg_sq


@dataclass
class StateBytes:
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


@dataclass
class MemoryEstimate:
    """Predicted bytes on one device (``host``: bytes moved to host memory by offload; ``disk``: bytes in the
    rank's NVMe offload file)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    host: int = 0
    disk: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows ``torch.chunk`` (and FSDP2) gives part ``index`` of ``parts`` along dim 0."""
    per = -(-rows // parts)
    return max(0, min(per, rows - index * per))


def zero1_owned(numels: list[int], ranks: int) -> list[int]:
    """Which rank owns each tensor under ``ZeroRedundancyOptimizer``: largest first (stable), each to the first
    rank with the fewest elements so far (torch's ``_partition_parameters``)."""
    owner, sizes = [0] * len(numels), [0] * ranks
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = sizes.index(min(sizes))
        owner[i] = rank
        sizes[rank] += numels[i]
    return owner


def _groups(parallel: ParallelConfig, world_size: int) -> tuple[int, int, int]:
    """``(dp, dense shard group size, expert shard group size)`` of a layout."""
    dp = parallel.resolve_data_parallel_size(world_size)
    dense = dp * parallel.context_parallel_size
    if parallel.data_parallel_shard_size is not None:
        dense = parallel.data_parallel_shard_size
    return dp, dense, dp // parallel.expert_parallel_size


def training_state(facts: ModelFacts, parallel: ParallelConfig, world_size: int, *, zero_stage: int | None = None,
                   pp_rank: int = 0, dp_rank: int = 0, cp_rank: int = 0) -> StateBytes:
    """Bytes of parameters, gradients and AdamW state one rank (``pp_rank``, ``dp_rank``, ``cp_rank``) holds after
    an optimizer step, wherever they live (device or host)."""
    stage = parallel.zero_stage if zero_stage is None else zero_stage
    key = ("state", stage, pp_rank, dp_rank, cp_rank, world_size, *(getattr(parallel, name) for name in _STATE_FIELDS))
    cached = facts.cache.get(key)
    if cached is None:
        cached = facts.cache[key] = _training_state(facts, parallel, world_size, stage, pp_rank, dp_rank, cp_rank)
    return StateBytes(cached.parameters, cached.gradients, cached.optimizer)


# the ParallelConfig fields the training state depends on (a cache key: activations, schedules' microbatches... not)
_STATE_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size", "pipeline_partition",
                 "context_parallel_size", "data_parallel_size", "data_parallel_shard_size", "expert_parallel_size",
                 "expert_tensor_parallel_size")


def _training_state(facts: ModelFacts, parallel: ParallelConfig, world_size: int, stage: int, pp_rank: int,
                    dp_rank: int, cp_rank: int) -> StateBytes:
    dp, dense_k, expert_k = _groups(parallel, world_size)
    tp, ep, etp, cp = (parallel.tensor_parallel_size, parallel.expert_parallel_size,
                       parallel.expert_tensor_parallel_size, parallel.context_parallel_size)
    params: list[ParamFact] = facts.parameters(parallel.pipeline_parallel_size, pp_rank,
                                               virtual_pipeline_size=parallel.virtual_pipeline_size,
                                               pipeline_partition=parallel.pipeline_partition,
                                               pipeline_schedule=parallel.pipeline_schedule)
    shapes = [p.local_shape(tp=tp, ep=ep if p.expert else 1, etp=etp if p.expert else 1) for p in params]
    # this rank's index in the dense / expert shard groups (mesh order (pp, dp, cp, tp); dp = edp * ep + e)
    dense_index = (dp_rank * cp + cp_rank) % dense_k
    expert_index = dp_rank // ep
    out = StateBytes()
    if stage == 1:
        owned = [False] * len(params)
        for expert in (False, True):
            members = [i for i, p in enumerate(params) if p.expert == expert]
            ranks = expert_k if expert else (dp if ep > 1 else dp * cp)
            index = expert_index if expert else (dp_rank if ep > 1 else dp_rank * cp + cp_rank)
            for i, owner in zip(members, zero1_owned([_numel(shapes[i]) for i in members], ranks)):
                owned[i] = owner == index
    for i, (p, shape) in enumerate(zip(params, shapes)):
        full = _numel(shape) * p.element_size
        if stage >= 2 and shape:
            k, index = (expert_k, expert_index) if p.expert else (dense_k, dense_index)
            local = _chunk_rows(shape[0], k, index) * _numel(shape[1:]) * p.element_size
            out.parameters += local
            out.gradients += local
            out.optimizer += MOMENTS * local + STEP_BYTES
            continue
        out.parameters += full
        out.gradients += full
        if stage != 1 or owned[i]:
            out.optimizer += MOMENTS * full + STEP_BYTES
    return out


# ---------------------------------------------------------------------------------------------- activations
def microbatches_in_flight(parallel: ParallelConfig, num_microbatches: int) -> float:
    """Microbatches whose activations the busiest pipeline rank (rank 0) holds at the peak of a step."""
    pp, v = parallel.pipeline_parallel_size, parallel.virtual_pipeline_size
    if pp == 1:
        return 1.0
    schedule = parallel.pipeline_schedule
    if schedule == "gpipe":
        return float(num_microbatches)
    if schedule == "interleaved_1f1b":  # Megatron: (1 + (pp - 1) / (pp v)) x pp microbatches of a full stage
        return min(float(num_microbatches), pp * (1 + (pp - 1) / (pp * v)))
    return float(min(pp, num_microbatches))  # 1f1b, zero_bubble (ZB-H1 keeps 1F1B's memory)


def _mlp_tiles(facts: ModelFacts, parallel: ParallelConfig, seq_len: int) -> int:
    """The slices of ``ParallelConfig.tiled_mlp`` for this rank's sequence (1: not tiled)."""
    from ..parallel_layers.tiled_mlp import tiles_for

    if parallel.tiled_mlp is None:
        return 1
    tp = parallel.tensor_parallel_size
    local = seq_len // parallel.context_parallel_size // (tp if parallel.sequence_parallel and tp > 1 else 1)
    return max(1, min(local, tiles_for(local, facts.hidden_size, parallel.tiled_mlp)))


def _activation_parts(facts: ModelFacts, parallel: ParallelConfig, *, micro_batch: int, seq_len: int,
                      num_microbatches: int, element_size: int | None, tiled_loss: bool) -> tuple[float, float]:
    """``(blocks, outside)``: the bytes the blocks of the forwards in flight keep, and what the embeddings, final
    norm and loss keep (single stage)."""
    tp, cp, pp = parallel.tensor_parallel_size, parallel.context_parallel_size, parallel.pipeline_parallel_size
    sp = parallel.sequence_parallel and tp > 1
    size = element_size or facts.parameters()[0].element_size
    tiled_loss = tiled_loss or parallel.tiled_loss  # the argument, or ParallelConfig.tiled_loss
    tokens = micro_batch * seq_len // cp
    per_layer = facts.activation_bytes_per_token_per_layer(seq_len // cp, tp=tp, sequence_parallel=sp,
                                                           element_size=size) * tokens
    if _mlp_tiles(facts, parallel, seq_len) > 1:  # the tiled MLP keeps only its input (counted with the norm)
        per_layer -= size * facts.mlp_elements_per_token() / tp * tokens
    block_input = size * facts.hidden_size * tokens / (tp if sp else 1)
    layers = -(-facts.num_layers // pp)
    mode = parallel.activation_checkpointing
    if mode is None:
        kept = layers * per_layer
    elif mode == "selective":  # the attention core is recomputed: its log-sum-exp is not kept
        kept = layers * (per_layer - size * facts.num_heads * tokens / tp)
    else:
        held = {"full": block_input, "partitioned": block_input / tp, "offload": 0.0}[mode]
        kept = layers * held
    in_flight = microbatches_in_flight(parallel, num_microbatches)
    outside = 0.0
    if pp == 1:
        outside = facts.outside_layers_bytes_per_token(tp=tp, sequence_parallel=sp, element_size=size,
                                                       tiled_loss=tiled_loss) * tokens
        outside += facts.tiled_loss_fixed_bytes(tp=tp) if tiled_loss else 0
    return kept * in_flight, outside


def activation_bytes(facts: ModelFacts, parallel: ParallelConfig, *, micro_batch: int, seq_len: int,
                     num_microbatches: int, element_size: int | None = None, tiled_loss: bool = False) -> int:
    """Activation bytes saved for backward on the device of the busiest rank (pipeline rank 0; without a pipeline
    the one stage, logits included) at the end of the forward passes in flight. The block being recomputed under
    checkpointing (or a tiled MLP's slice) is a transient (``recompute_bytes``). ``ParallelConfig.tiled_mlp``: no
    ``[s, ffn]`` term; ``tiled_loss`` (``skip_logits=True``): no logits; ``ParallelConfig.activation_offload``: the
    blocks' share is in host memory (``offloaded_activation_bytes``), not here."""
    blocks, outside = _activation_parts(facts, parallel, micro_batch=micro_batch, seq_len=seq_len,
                                        num_microbatches=num_microbatches, element_size=element_size,
                                        tiled_loss=tiled_loss)
    return int((0 if _offloads(parallel) else blocks) + outside)


def _offloads(parallel: ParallelConfig) -> bool:
    from ..training.activation_offload import check_setting

    return check_setting(parallel.activation_offload) is not None


def offloaded_activation_bytes(facts: ModelFacts, parallel: ParallelConfig, *, micro_batch: int, seq_len: int,
                               num_microbatches: int, element_size: int | None = None) -> int:
    """The blocks' saved activations held in host memory under ``ParallelConfig.activation_offload`` (0 without:
    a tensor below the offload's byte threshold stays on the device; the model counts every one as moved)."""
    if not _offloads(parallel):
        return 0
    blocks, _ = _activation_parts(facts, parallel, micro_batch=micro_batch, seq_len=seq_len,
                                  num_microbatches=num_microbatches, element_size=element_size, tiled_loss=False)
    return int(blocks)


def recompute_bytes(facts: ModelFacts, parallel: ParallelConfig, *, micro_batch: int, seq_len: int,
                    element_size: int | None = None) -> int:
    """The transient of the backward: one block's activations rebuilt under activation checkpointing (its MLP one
    slice's worth when tiled), or, tiled without checkpointing, one MLP slice recomputed (0 with neither)."""
    tiles = _mlp_tiles(facts, parallel, seq_len)
    if parallel.activation_checkpointing is None and tiles == 1:
        return 0
    tp, cp = parallel.tensor_parallel_size, parallel.context_parallel_size
    size = element_size or facts.parameters()[0].element_size
    tokens = micro_batch * seq_len // cp
    mlp = size * facts.mlp_elements_per_token() / tp * tokens
    if parallel.activation_checkpointing is None:
        return int(mlp / tiles)
    block = facts.activation_bytes_per_token_per_layer(
        seq_len // cp, tp=tp, sequence_parallel=parallel.sequence_parallel and tp > 1, element_size=size) * tokens
    return int(block - mlp + mlp / tiles)


def estimate_memory(facts: ModelFacts, parallel: ParallelConfig, world_size: int, *, zero_stage: int | None = None,
                    cpu_offload: bool = False, micro_batch: int = 1, seq_len: int = 1, num_microbatches: int = 1,
                    mixed_precision: str = "no", device: str = "cuda", tiled_loss: bool = False) -> MemoryEstimate:
    """The busiest rank's memory: the largest training state over pipeline ranks, activations of pipeline rank 0,
    and the transient buffers (DDP's gradient buckets at stages 0/1 without pipeline; FSDP2's gathered
    parameters: all of the rank's at stage 2, the largest two blocks (current + prefetched) at stage 3).
    ``device``: where the model trains (``"cpu"``: the NVMe tier's chunk is updated in the host buffer itself)."""
    stage = parallel.zero_stage if zero_stage is None else zero_stage
    pp = parallel.pipeline_parallel_size
    # uniform partitions: the middle pipeline ranks hold the same (the first adds embeddings, the last the head)
    ranks = range(pp) if parallel.pipeline_partition != "uniform" else sorted({0, min(1, pp - 1), pp - 1})
    states = [training_state(facts, parallel, world_size, zero_stage=stage, pp_rank=r) for r in ranks]
    state = max(states, key=lambda s: s.total)
    element = 2 if mixed_precision in ("bf16", "fp16") else None
    activations = activation_bytes(facts, parallel, micro_batch=micro_batch, seq_len=seq_len,
                                   num_microbatches=num_microbatches, element_size=element, tiled_loss=tiled_loss)
    offloaded = offloaded_activation_bytes(facts, parallel, micro_batch=micro_batch, seq_len=seq_len,
                                           num_microbatches=num_microbatches, element_size=element)
    unsharded = training_state(facts, parallel, world_size, zero_stage=0, pp_rank=0).parameters
    dp = parallel.resolve_data_parallel_size(world_size) * parallel.context_parallel_size
    buffers = 0
    if stage <= 1 and pp == 1 and dp > 1:
        buffers = state.gradients  # DDP's bucket copy of the gradients
    elif stage == 2:
        buffers = unsharded
    elif stage == 3:
        buffers = 2 * unsharded // max(1, -(-facts.num_layers // pp))
    buffers += recompute_bytes(facts, parallel, micro_batch=micro_batch, seq_len=seq_len, element_size=element)
    if cpu_offload or parallel.offload == "cpu":
        return MemoryEstimate(0, 0, 0, activations, buffers, host=state.total + offloaded)
    if parallel.offload == "nvme":
        from ..training.nvme_offload import DEFAULT_CHUNK_BYTES

        disk = MOMENTS * state.parameters  # ZeRO 0/2/3: every local shard's moments (stage 1 is refused)
        chunks = 2 * min(DEFAULT_CHUNK_BYTES, disk)  # updated + written back/prefetched; a chunk is on the
        buffers += min(DEFAULT_CHUNK_BYTES, disk) if device != "cpu" else 0  # device while it is updated
        on_disk = state.parameters if parallel.offload_params else 0  # nvme_params.py: ZeRO-3 shards in a file
        return MemoryEstimate(state.parameters - on_disk, state.gradients, 0, activations, buffers,
                              host=state.optimizer - disk + chunks + offloaded, disk=disk + on_disk)
    return MemoryEstimate(state.parameters, state.gradients, state.optimizer, activations, buffers, host=offloaded)
