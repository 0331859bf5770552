"""``--profile`` in a launched world (``planner/profile_parallel.py``), 2 gloo processes: the blocks timed with their
real process groups. The grouped model is the family's real model on a real ``ParallelContext`` (tp's weights are
the local shards; the ring attention under cp; FSDP2 or DDP wrapping the data-parallel one), its timed forward +
backward runs the collectives (counted by a dispatch mode: a profile that timed a block alone would count none),
the timed optimizer step is the wrapper's (ZeRO-1's broadcasts), keys the world cannot host are ``None`` (the link
model stands in), the ranks end with the same figures after ``combine``, and ``estimate_time`` charges the grouped
block minus the block alone and takes the timed optimizer step.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import oslo_models as om
from oslo_models.planner import Hardware, ModelFacts, Profiler
from oslo_models.planner.profile_parallel import parallel_key
from oslo_models.planner.time import estimate_time
from tests.helpers.decoders import tiny_config
from tests.helpers.dist import run_distributed


class _Collectives(TorchDispatchMode):
    """Counts the ``c10d`` ops dispatched inside it (the layers' collectives, DDP's reducer, FSDP2's)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d."):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _collectives(profiler, model, arguments) -> list[str]:
    tp, sp, cp, seq, micro_batch, checkpointing, wrapper, shard = arguments
    batch = profiler.groups._batch(profiler.groups._context(tp, sp, cp, wrapper[0] if wrapper else 0, shard),
                                   micro_batch, seq)
    with _Collectives() as seen:
        profiler._run(model, batch)
    return seen.ops


def _world():
    from oslo_models.distributed.context import init_process_group_from_environment

    if not dist.is_initialized():
        init_process_group_from_environment("cpu")
    facts = ModelFacts(om.LlamaForCausalLM, tiny_config("llama", num_hidden_layers=1))
    profiler = Profiler(facts, repeats=1, groups=True)
    tp = profiler.parallel_block(2, False, 1, 8, 2, None)
    sp = profiler.parallel_block(2, True, 1, 8, 2, None)
    cp = profiler.parallel_block(1, False, 2, 8, 2, None)
    zero3 = profiler.parallel_block(1, False, 1, 8, 2, None, wrapper=(3, 2))
    ddp = profiler.parallel_block(1, False, 1, 8, 2, None, wrapper=(1, 2))
    for figures in (tp, sp, cp, zero3, ddp):
        assert figures is not None and len(figures) == 4 and figures[0] > 0 and min(figures) >= 0, figures
    assert len(profiler.groups.runs) == 5
    # what a 2-rank world cannot host: tp4; a wrapper whose dp x cp x tp is not the world
    assert profiler.parallel_block(4, False, 1, 8, 2, None) is None
    assert profiler.parallel_block(2, False, 1, 8, 2, None, wrapper=(0, 2)) is None
    assert profiler.parallel_block(1, False, 1, 8, 2, None, wrapper=(3, 4)) is None
    assert len(profiler.groups.runs) == 5

    models = profiler.groups._models
    full = tiny_config("llama").hidden_size  # q_proj rows at tp1
    tp_model = models[(2, False, 1, 1, None, None, None)][0]
    assert tp_model.model.layers[0].self_attn.q_proj.weight.shape[0] == full // 2  # the rank's shard
    zero3_model = models[(1, False, 1, 1, None, (3, 2), None)][0]
    assert all(hasattr(p, "to_local") for p in zero3_model.parameters())  # FSDP2's DTensors
    for arguments, kind in (((2, False, 1, 8, 2, None, None, None), "allreduce"),
                            ((2, True, 1, 8, 2, None, None, None), "reduce_scatter"),
                            ((1, False, 2, 8, 2, None, None, None), None),  # the ring's sends (op names vary)
                            ((1, False, 1, 8, 2, None, (3, 2), None), "allgather")):
        layers = 1 + 2
        model = models[arguments[:3] + (layers, None, arguments[6], None)][0]
        ops = _collectives(profiler, model, arguments)
        assert ops and (kind is None or any(kind in op for op in ops)), (arguments, ops)
    model, optimizer = models[(1, False, 1, 1, None, (1, 2), None)]  # ZeRO-1: the step broadcasts the shards
    _collectives(profiler, model, (1, False, 1, 8, 2, None, (1, 2), None))
    with _Collectives() as seen:
        optimizer.step()
    assert any("broadcast" in op for op in seen.ops), seen.ops
    optimizer.zero_grad(set_to_none=True)

    # the ranks agree after combine (the fastest rank's raw times), and refine keeps every key
    profiler.refine(1)
    profiler.combine(lambda values: _least(values))
    mine = torch.tensor([v for key in sorted(profiler.parallel) for v in profiler.parallel[key]], dtype=torch.float64)
    other = mine.clone()
    dist.broadcast(other, src=0)
    assert torch.equal(mine, other)

    # the estimate: measured tp communication = grouped - alone (block x layers + outside), per microbatch
    hw = replace(Hardware.default("cpu"), profile=profiler, overlap=0.0)
    estimate = estimate_time(facts, om.ParallelConfig(tensor_parallel_size=2), 2, hw, global_batch=2, seq_len=8,
                             micro_batch=2, num_microbatches=1, param_bytes=10**5)
    block, outside, step, step_outside = profiler.parallel[parallel_key(2, False, 1, 8, 2, None)]
    expected = max(0.0, block - profiler.block(2, 8, 2) + outside - profiler.outside(2, 8, 2))
    assert abs(estimate.communication["tp"] - expected) < 1e-12
    assert abs(estimate.compute - (profiler.block(2, 8, 2) + profiler.outside(2, 8, 2) + step + step_outside)) < 1e-12


def _least(values):
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor.tolist()


def test_profile_times_blocks_with_their_groups():
    run_distributed(_world, 2, timeout=300)
