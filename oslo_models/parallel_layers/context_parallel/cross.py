"""Cross-attention of an encoder-decoder under context parallelism: every decoder chunk attends to the *whole* encoder
output, which each cp rank holds in chunk(s) (the encoder ran context-parallel too).

``gather_encoder_states(x, context)``: ``[b, s_enc_local, ...]`` -> ``[b, s_enc, ...]`` in global token order (one
all-gather over cp, then ``merge_sequence`` of the layout's chunks). Backward: every cp rank's decoder read the
gathered states, so the gradient of this rank's chunk is the *sum* over cp of what each rank's backward left at
those positions (one all-reduce of ``[b, s_enc, ...]`` over cp, then this rank's chunk(s)). Under the gradient
convention of ``loss.py`` (each rank's backward is ``cp`` times its share) that gives the chunk ``cp`` times its
gradient of the whole loss, as every other weight gets. (``models/common/stack/context_parallel.gather_over_context``
is the other rule: every rank computes the *same* value from the gathered tensor, so it keeps its own chunk.)

``gather_encoder_mask(mask, context)``: the encoder's 2D padding mask ``[b, s_enc_local]`` -> ``[b, s_enc]`` (one
all-gather, no gradient).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .chunking import merge_sequence, split_sequence


def _gather(x: torch.Tensor, group, size: int, mode: str, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return merge_sequence(parts, mode, dim=dim)


class _GatherSummingGradients(torch.autograd.Function):
    """Forward: the whole sequence from every cp rank's chunk(s). Backward: the gradient summed over cp, this rank's
    chunk(s) of it (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group, rank, size, mode, dim):
        ctx.group, ctx.rank, ctx.size, ctx.mode, ctx.dim = group, rank, size, mode, dim
        return _gather(x, group, size, mode, dim)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return split_sequence(total, ctx.rank, ctx.size, ctx.mode, ctx.dim), None, None, None, None, None


def gather_summing_gradients(x: torch.Tensor, group, rank: int, size: int, mode: str, dim: int = 1) -> torch.Tensor:
    """``x`` (this rank's chunk(s) along ``dim``) -> the whole sequence over the cp ``group`` of ``size`` (layout
    ``mode``); backward: the gradient summed over the group, this rank's chunk(s) (see the module docstring)."""
    return _GatherSummingGradients.apply(x, group, rank, size, mode, dim)


def gather_encoder_states(x: torch.Tensor, context, dim: int = 1) -> torch.Tensor:
    """See the module docstring; ``x`` itself at cp=1."""
    if context.cp_size == 1:
        return x
    return gather_summing_gradients(x, context.cp_group, context.cp_rank, context.cp_size,
                                    context.config.context_parallel_mode, dim)


def gather_encoder_mask(mask: torch.Tensor | None, context) -> torch.Tensor | None:
    """The encoder padding mask of the whole sequence ``[b, s_enc]`` (``None`` stays ``None``; itself at cp=1)."""
    if mask is None or context.cp_size == 1:
        return mask
    return _gather(mask, context.cp_group, context.cp_size, context.config.context_parallel_mode, 1)
