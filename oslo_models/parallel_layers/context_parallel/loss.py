"""The loss of a context-parallel group: one mean over the tokens of all its chunks.

Each cp rank computes ``sum of its tokens' losses / N`` with ``N`` the label count of the *whole* sequence (one
all-reduce of the counts), and the group's loss is the sum of those (one all-reduce): every rank returns the
full-sequence loss. Backward of that sum is the identity times ``cp``: each rank's weight gradients are then ``cp``
times its partial share, and the gradient *average* over dp x cp (DDP / ZeRO-1 over ``dp_cp_group``) sums the
partial shares of one sequence exactly (and averages the replicas).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroups(torch.autograd.Function):
    """Forward: all-reduce sum over each group of ``groups`` in turn. Backward: ``grad * scale``."""

    @staticmethod
    def forward(ctx, x, groups, scale):
        ctx.scale = scale
        out = x.detach().clone()
        for group in groups:
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None


def context_num_items(context, labels: torch.Tensor, num_items_in_batch=None, ignore_index: int = -100):
    """Labelled tokens of the whole sequence (summed over cp; no autograd): ``num_items_in_batch`` if given (it
    counts this rank's chunk, e.g. a trainer's count over its own batch), else ``labels != ignore_index``."""
    count = (labels != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    count = torch.as_tensor(count, dtype=torch.float32, device=labels.device).clone()
    dist.all_reduce(count, group=context.cp_group)
    return count


def sum_over_context(loss: torch.Tensor, context) -> torch.Tensor:
    """Forward: all-reduce sum over cp. Backward: ``grad * cp`` (see the module docstring)."""
    return _SumOverGroups.apply(loss, (context.cp_group,), context.cp_size)


def token_groups(context) -> tuple:
    """The groups of size > 1 that split one replica's tokens among ranks holding the same weights: cp (chunks of
    the sequences) and, under the 2D / 2.5D grid, its column and depth groups (batch blocks; the ranks of a grid
    row share a batch block and hold the same whole-token values where this is used)."""
    groups = [context.cp_group] if context.cp_size > 1 else []
    if context.is_grid and context.tensor_parallel_mode != "3d":
        from ..summa import Grid

        grid = Grid.from_context(context)
        groups += [axis.group for axis in (grid.col, grid.dep) if axis.size > 1]
    return tuple(groups)


def sum_over_replica_tokens(x: torch.Tensor, context) -> torch.Tensor:
    """Per-token sums (e.g. the load-balancing loss's routing statistics) of this rank's tokens -> those of the whole
    replica, on every rank: all-reduce over ``token_groups``. Backward: ``grad * cp``, as ``sum_over_context``
    (dp x cp averages the gradients); the grid's batch groups add no factor, since the grid sums the gradients of
    its replicated weights over them itself (``tensor_parallel_2d.replicated_over_batch``)."""
    groups = token_groups(context)
    return _SumOverGroups.apply(x, groups, context.cp_size) if groups else x
