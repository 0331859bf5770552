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


class _SumOverContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.size = size
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None, None


def context_num_items(context, labels: torch.Tensor, num_items_in_batch=None, ignore_index: int = -100):
    """Labelled tokens of the whole sequence (summed over cp; no autograd): ``num_items_in_batch`` if given (it
    counts this rank's chunk, e.g. a trainer's count over its own batch), else ``labels != ignore_index``."""
    count = (labels != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    count = torch.as_tensor(count, dtype=torch.float32, device=labels.device).clone()
    dist.all_reduce(count, group=context.cp_group)
    return count


def sum_over_context(loss: torch.Tensor, context) -> torch.Tensor:
    """Forward: all-reduce sum over cp. Backward: ``grad * cp`` (see the module docstring)."""
    return _SumOverContext.apply(loss, context.cp_group, context.cp_size)
