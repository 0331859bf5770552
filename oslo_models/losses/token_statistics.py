"""Per-token log-probabilities of given tokens, entropy and the statistics TRL logs, over a vocab-split softmax.

With ``z = logits / temperature`` (fp32) of this rank's columns and ``t`` the target id of a row:

    forward:  m   = all-reduce MAX of max(z)                            (a shift; not differentiated)
              [S, X, Q, Z, T] = all-reduce SUM of [sum e, sum e z, sum e^2, sum z (finite), z[t] if owned]
                                 with e = exp(z - m)                     (one all-reduce of a [5, tokens] tensor)
              lse = m + log S;  log_prob = T - lse;  entropy = lse - X / S
              log_sum_sq_probs = log Q - 2 log S;  mean_logits = Z / V;  is_top1 from a second MAX row
    backward: d log_prob / dz = onehot(t) - p;  d entropy / dz = -p (log p + entropy)   (local: no collective)

where ``p = exp(z - lse)`` is recomputed chunk by chunk in the backward from the saved logits and ``lse``. The
gradient with respect to the given logits carries the ``1 / temperature``. Rows whose target is ``ignore_index``
get ``log_prob = 0`` and no gradient through it; entropy is computed for every row (mask it yourself).

``is_top1`` follows ``torch.argmax``: the target holds the largest logit and no smaller id holds the same value
(the largest value among ids before the target is the second row of the MAX all-reduce). ``log_sum_sq_probs``,
``mean_logits`` and ``is_top1`` carry no gradient, as in TRL's fused head (``trl.trainer.utils.add_fused_lm_head``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .vocab_shard import VocabShard, as_rows, check_temperature, chunk_rows, finite_or_zero, row_slices

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class _TokenStatistics(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, shard: VocabShard, ignore_index: int, temperature: float, rows_per_chunk: int,
                outputs: tuple):
        rows = as_rows(logits)
        num_rows, num_local = rows.shape
        targets = targets.reshape(-1)
        valid = targets != ignore_index
        owned, local = shard.local_ids(torch.where(valid, targets, -1), num_local)
        inv_t = 1.0 / temperature
        chunks = row_slices(num_rows, rows_per_chunk)
        device = rows.device
        top1 = "is_top1" in outputs
        columns = torch.arange(num_local, device=device)
        target_local = targets - shard.vocab_start  # unclamped: ids in later shards count every column as before
        maxes = torch.full((2 if top1 else 1, num_rows), -math.inf, device=device)
        for piece in chunks:
            z = rows[piece].float() * inv_t
            maxes[0, piece] = z.amax(-1)
            if top1:
                before = columns < target_local[piece].unsqueeze(-1)
                maxes[1, piece] = z.masked_fill(~before, -math.inf).amax(-1)
        shard.all_reduce(maxes, dist.ReduceOp.MAX)
        row_max = maxes[0]

        sums = torch.zeros(5, num_rows, device=device)
        for piece in chunks:
            z = rows[piece].float() * inv_t
            e = torch.exp(z - row_max[piece].unsqueeze(-1))
            sums[0, piece] = e.sum(-1)
            if "entropy" in outputs:
                sums[1, piece] = finite_or_zero(z, e).sum(-1)
            if "log_sum_sq_probs" in outputs:
                sums[2, piece] = (e * e).sum(-1)
            if "mean_logits" in outputs:
                sums[3, piece] = z.masked_fill(torch.isneginf(z), 0.0).sum(-1)
            target = z.gather(-1, local[piece].unsqueeze(-1)).squeeze(-1)
            sums[4, piece] = torch.where(owned[piece], target, torch.zeros((), device=device))
        shard.all_reduce(sums)
        lse = row_max + sums[0].log()
        zero = torch.zeros((), device=device)
        log_probs = torch.where(valid, sums[4] - lse, zero)
        entropy = lse - sums[1] / sums[0] if "entropy" in outputs else None
        log_sum_sq = sums[2].log() - 2 * sums[0].log() if "log_sum_sq_probs" in outputs else None
        mean_logits = None
        if "mean_logits" in outputs:
            vocab = shard.vocab_size if shard.vocab_size is not None else num_local * shard.size
            mean_logits = sums[3] / vocab
        is_top1 = valid & (sums[4] >= row_max) & (sums[4] > maxes[1]) if top1 else None

        shape = logits.shape[:-1]
        ctx.save_for_backward(logits, lse, entropy if entropy is not None else lse, owned, local, valid)
        ctx.shard, ctx.inv_t, ctx.rows_per_chunk = shard, inv_t, rows_per_chunk
        results = [log_probs, entropy, log_sum_sq, mean_logits, is_top1]
        ctx.mark_non_differentiable(*(x for x in results[2:] if x is not None))
        return tuple(None if x is None else x.view(shape) for x in results)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, *_):
        logits, lse, entropy, owned, local, valid = ctx.saved_tensors
        rows = as_rows(logits)
        grad = torch.empty_like(rows)
        gl = None if grad_log_probs is None else (grad_log_probs.reshape(-1).float() * valid)
        ge = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        for piece in row_slices(rows.shape[0], ctx.rows_per_chunk):
            z = rows[piece].float() * ctx.inv_t
            log_p = z - lse[piece].unsqueeze(-1)
            p = torch.exp(log_p)
            g = torch.zeros_like(z)
            if gl is not None:
                g -= p * gl[piece].unsqueeze(-1)
                hit = (owned[piece].float() * gl[piece]).unsqueeze(-1)
                g.scatter_add_(-1, local[piece].unsqueeze(-1), hit)
            if ge is not None:
                g -= finite_or_zero(log_p + entropy[piece].unsqueeze(-1), p) * ge[piece].unsqueeze(-1)
            grad[piece] = (g * ctx.inv_t).to(grad.dtype)
        return grad.view(logits.shape), None, None, None, None, None, None


def token_statistics(logits: torch.Tensor, targets: torch.Tensor, *, shard: VocabShard | None = None,
                     outputs=FIELDS, ignore_index: int = -100, temperature: float = 1.0,
                     chunk_size: int | None = None) -> dict:
    """Per-token fields of the softmax of ``logits / temperature`` over the whole vocabulary (see the module
    docstring), each ``[...]`` fp32 (``is_top1`` bool) for ``logits [..., V_padded/tp]`` (this rank's columns,
    padded ones ``-inf``) and ``targets [...]`` (global ids; ``ignore_index`` for none): a dict with the names in
    ``outputs`` (any of ``FIELDS``). ``log_probs`` and ``entropy`` are differentiable with respect to ``logits``.

    Collectives (over ``shard.group``): forward one all-reduce MAX of ``[1 or 2, tokens]`` and one all-reduce SUM
    of ``[5, tokens]``; backward none. ``chunk_size``: rows per fp32 chunk (default: 16 MiB worth)."""
    shard = shard or VocabShard()
    unknown = set(outputs) - set(FIELDS)
    if unknown:
        raise ValueError(f"Unknown output(s) {sorted(unknown)}; choose among {FIELDS}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have the logits' shape without the vocabulary "
                         f"dimension, {tuple(logits.shape[:-1])}")
    rows = chunk_rows(targets.numel(), logits.shape[-1], chunk_size)
    values = _TokenStatistics.apply(logits, targets.to(logits.device), shard, ignore_index,
                                    check_temperature(temperature), rows, tuple(outputs))
    return {name: value for name, value in zip(FIELDS, values) if name in outputs}
