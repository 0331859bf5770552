"""Autograd collectives that move activations in and out of tensor-parallel and sequence-parallel regions.

Each function takes the group explicitly; ``group=None`` (or a group of one rank) is the identity, so the same
layer code runs single-process. Names follow Megatron-LM (Shoeybi et al., 2019, arXiv:1909.08053, where the
first two are the ``f`` and ``g`` operators); the activation layout is HF's ``[batch, seq, hidden]``.

| function                                   | forward                 | backward                |
|--------------------------------------------|-------------------------|-------------------------|
| ``copy_to_tensor_parallel_region``         | identity                | all-reduce              |
| ``reduce_from_tensor_parallel_region``     | all-reduce              | identity                |
| ``gather_from_tensor_parallel_region``     | all-gather (dim)        | split (dim)             |
| ``scatter_to_tensor_parallel_region``      | split (dim)             | all-gather (dim)        |
| ``scatter_to_sequence_parallel_region``    | split (seq)             | all-gather (seq)        |
| ``gather_from_sequence_parallel_region``   | all-gather (seq)        | reduce-scatter or split |
| ``reduce_scatter_to_sequence_parallel_region`` | reduce-scatter (seq) | all-gather (seq)        |
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1  # HF layout [batch, seq, hidden]


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---------------------------------------------------------------------------------------------- raw collectives
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()  # never reduce in place: autograd may have saved ``x``
    dist.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"Cannot split dim {dim} of size {x.shape[dim]} over {world} tensor-parallel ranks")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"Cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {world} ranks")
    # The chunks concatenated along dim 0 and the *_tensor collective: torch.compile traces it (as a functional
    # collective); the list form of reduce_scatter is a graph break.
    chunks = x.chunk(world, dim=dim)
    out = torch.empty(chunks[0].shape, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, torch.cat(chunks, dim=0), group=group)
    return out


# ---------------------------------------------------------------------------------------------- autograd functions
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _all_gather(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter(grad, ctx.group, SEQUENCE_DIM), None, None
        return _split(grad, ctx.group, SEQUENCE_DIM), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, SEQUENCE_DIM), None


# ---------------------------------------------------------------------------------------------- public API
def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region with a replicated input. Forward: identity. Backward: all-reduce (sum) over ``group``.

    Also used on replicated parameters that see only this rank's tokens under sequence parallelism (norm
    weights, row-parallel biases): the backward all-reduce sums the per-rank partial gradients.
    """
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region holding partial sums. Forward: all-reduce (sum). Backward: identity."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate per-rank shards along ``dim``. Forward: all-gather. Backward: keep this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, dim)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of a replicated tensor along ``dim``. Forward: split. Backward: all-gather."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s, h]`` replicated -> ``[b, s/tp, h]``. Forward: split along seq. Backward: all-gather along seq."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, SEQUENCE_DIM)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, *, grad_is_partial: bool) -> torch.Tensor:
    """``[b, s/tp, h]`` -> ``[b, s, h]``. Forward: all-gather along seq.

    Backward: reduce-scatter when the consumer is tensor-parallel (each rank's gradient is a partial sum, e.g.
    the input of a column-parallel linear), plain split when the consumer is replicated (gradients equal).
    """
    return x if group_size(group) == 1 else _GatherFromSequenceRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums ``[b, s, h]`` -> summed ``[b, s/tp, h]``. Forward: reduce-scatter. Backward: all-gather."""
    return x if group_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)
