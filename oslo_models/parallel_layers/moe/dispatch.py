"""Token dispatch and combine for mixture-of-experts layers, with all-to-all over the expert-parallel group.

Experts are split over the ``ep`` ranks in contiguous blocks: rank ``r`` holds experts ``r*E/ep .. (r+1)*E/ep``.
Each rank routes its own tokens; a token's copy for expert ``e`` travels to the rank that holds ``e`` and comes
back after the expert ran. Token counts per expert vary from step to step, so the exchange is
``all_to_all_single`` with split sizes (the counts are exchanged first, one small all-to-all of ``E`` integers).

| function / class            | forward                                   | backward                               |
|-----------------------------|-------------------------------------------|----------------------------------------|
| ``all_to_all`` (``_AllToAll``) | all-to-all (send splits -> recv splits) | all-to-all (recv splits -> send splits) |
| ``dispatch``                | sort by expert, all-to-all, group by local expert | autograd through the same ops   |
| ``combine``                 | inverse of ``dispatch``, weighted sum over the top-k | autograd                     |

Bytes moved per layer and direction: ``assignments x hidden x bytes x (ep - 1) / ep`` for a uniform router
(``assignments = tokens x top_k``, less dropped tokens), once in ``dispatch`` and once in ``combine``, and the same
again in backward. With ``group=None`` (ep = 1) nothing is communicated and the same code runs single-process;
there every assignment keeps a row (the dropped ones zeroed, after the last expert's, masked in ``combine``), so
the shapes do not depend on the routing and ``torch.compile`` traces dispatch and combine with no graph break.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..mappings import group_size


class _AllToAll(torch.autograd.Function):
    """Variable-size all-to-all of rows; backward sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Rows ``[sum(send_splits), ...]`` -> ``[sum(recv_splits), ...]`` over ``group`` (identity for one rank)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)


@dataclass
class Dispatched:
    """What ``combine`` needs to undo ``dispatch``. ``local_counts``: rows per local expert in ``rows``."""

    rows: torch.Tensor           # [R, h] token copies for this rank's experts, grouped by local expert
    local_counts: torch.Tensor   # [E_local] int64
    order: torch.Tensor          # [A] assignment index of each sorted row (A = kept assignments; ep = 1: all)
    tokens: torch.Tensor         # [A] token index of each sorted row
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor | None  # [R] permutation from arrival order to local-expert order (ep > 1)
    kept: torch.Tensor | None = None  # ep = 1: [A] whether each sorted row is a kept assignment (dropped ones last)


def dispatch(hidden_states: torch.Tensor, expert_index: torch.Tensor, num_experts: int, group) -> Dispatched:
    """Send each kept (token, expert) assignment to the rank that holds the expert.

    Args:
        hidden_states: ``[T, h]`` this rank's tokens.
        expert_index: ``[T, k]`` chosen experts; an index outside ``[0, num_experts)`` marks a dropped assignment
            (capacity overflow), which is not sent and contributes nothing.
        num_experts: all experts of the layer (over all ep ranks).
        group: the expert-parallel group (``None``: one rank holds every expert).
    """
    ep = group_size(group)
    top_k = expert_index.shape[-1]
    flat = expert_index.reshape(-1)
    kept = (flat >= 0) & (flat < num_experts)
    keys = torch.where(kept, flat, torch.full_like(flat, num_experts))  # dropped sort last
    order = torch.argsort(keys, stable=True)
    if ep == 1:
        # every assignment keeps its row, the dropped ones (zeroed) after the last expert's: static shapes, no host
        # sync, so torch.compile traces it whole; the experts run sum(counts) rows, combine masks the rest
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
        counts = counts.index_add(0, keys, torch.ones_like(keys))[:num_experts]
        tokens = order // top_k
        kept_sorted = kept.index_select(0, order)
        rows = torch.where(kept_sorted[:, None], hidden_states.index_select(0, tokens), 0)
        return Dispatched(rows, counts, order, tokens, [flat.shape[0]], [flat.shape[0]], None, kept_sorted)
    num_kept = int(kept.sum())
    order = order[:num_kept]
    tokens = order // top_k
    counts = torch.bincount(flat[order], minlength=num_experts)  # [E]
    rows = hidden_states.index_select(0, tokens)
    local = num_experts // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [ep * E_local]: counts of my experts per source rank
    received = received.view(ep, local)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    rows = all_to_all(rows, send_splits, recv_splits, group)  # arrival order: source rank, then local expert
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep), received.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    return Dispatched(rows.index_select(0, regroup), received.sum(0), order, tokens, send_splits, recv_splits,
                      regroup)


def combine(expert_output: torch.Tensor, dispatched: Dispatched, weights: torch.Tensor, num_tokens: int,
            group) -> torch.Tensor:
    """Bring the experts' rows back and sum them per token, each scaled by its routing weight.

    ``expert_output``: ``[R, h]`` in ``dispatched.rows`` order; ``weights``: ``[T, k]``. Returns ``[T, h]``.
    """
    rows = expert_output
    if dispatched.regroup is not None:
        inverse = torch.empty_like(dispatched.regroup)
        inverse[dispatched.regroup] = torch.arange(len(inverse), device=inverse.device)
        rows = all_to_all(rows.index_select(0, inverse), dispatched.recv_splits, dispatched.send_splits, group)
    scale = weights.reshape(-1).index_select(0, dispatched.order)
    rows = (rows * scale[:, None]).to(expert_output.dtype)
    if dispatched.kept is not None:  # ep = 1: the dropped assignments' rows (after every expert's) add nothing
        rows = torch.where(dispatched.kept[:, None], rows, 0)
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    return out.index_add(0, dispatched.tokens, rows)
