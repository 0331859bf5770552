"""KL divergence from a teacher given as its top-k logits and their vocabulary ids, to vocab-split student logits.

A teacher at another size or layout (or one run offline) hands over ``values [..., k]`` (its logits at the ids
``indices [..., k]``, global vocabulary ids, e.g. from :func:`~oslo_models.losses.topk_logits`) instead of its whole
distribution. The teacher's distribution is ``p = softmax(values / T)`` renormalized over those ``k`` ids. With
``s = student / T`` of this rank's columns and ``s_k`` the student's logits at the ``k`` ids:

    forward KL(p || q) = sum_k p_k (log p_k - log q_k),   log q_k = s_k - lse_s  (q: the student over the WHOLE
                         vocabulary, so the mass it puts outside the top-k is penalized through lse_s)
    reverse KL(r || p) = sum_k r_k (log r_k - log p_k),   r = softmax(s_k)  (the student renormalized over the
                         top-k ids: the only support on which the teacher's log-probabilities are known)

    forward:  m_s = all-reduce MAX of the row maxima (forward KL only)
              [S_s | s_k] = all-reduce SUM of [sum exp(s - m_s) | s at the ids this rank owns, 0 elsewhere]
                           (one [tokens, k + 1] all-reduce)
    backward (student only): forward KL: dKL/ds = q - scatter(p);  reverse KL: dKL/ds_k = r_k (log r_k - log p_k -
              KL) at the k ids, 0 elsewhere                                                     (local: no collective)

With ``k`` equal to the vocabulary size both equal :func:`~oslo_models.losses.kl_divergence` (the reverse one then
renormalizes over the whole vocabulary, i.e. not at all).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .divergence import DIRECTIONS
from .vocab_shard import VocabShard, as_rows, check_temperature, chunk_rows, finite_or_zero, row_slices


class _TopKDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, values, indices, shard: VocabShard, reverse: bool, temperature: float,
                rows_per_chunk: int):
        rows = as_rows(student)
        num_rows, num_local = rows.shape
        k = values.shape[-1]
        inv_t = 1.0 / temperature
        log_p = torch.log_softmax(values.detach().reshape(num_rows, k).float() * inv_t, dim=-1)
        owned, local = shard.local_ids(indices.reshape(num_rows, k), num_local)
        chunks = row_slices(num_rows, rows_per_chunk)
        device = rows.device
        row_max = torch.full((num_rows,), -math.inf, device=device)
        if not reverse:
            for piece in chunks:
                row_max[piece] = (rows[piece].float() * inv_t).amax(-1)
            shard.all_reduce(row_max, dist.ReduceOp.MAX)
        sums = torch.zeros(num_rows, k + 1, device=device)
        for piece in chunks:
            s = rows[piece].float() * inv_t
            if not reverse:
                sums[piece, 0] = torch.exp(s - row_max[piece].unsqueeze(-1)).sum(-1)
            picked = s.gather(-1, local[piece])
            sums[piece, 1:] = torch.where(owned[piece], picked, torch.zeros((), device=device))
        shard.all_reduce(sums)
        s_k = sums[:, 1:]
        if reverse:
            log_r = torch.log_softmax(s_k, dim=-1)
            kl = finite_or_zero(log_r - log_p, log_r.exp()).sum(-1)
            saved = log_r
        else:
            lse = row_max + sums[:, 0].log()
            kl = finite_or_zero(log_p - (s_k - lse.unsqueeze(-1)), log_p.exp()).sum(-1)
            saved = lse.unsqueeze(-1)
        ctx.save_for_backward(student, log_p, owned, local, saved, kl)
        ctx.reverse, ctx.inv_t, ctx.rows_per_chunk = reverse, inv_t, rows_per_chunk
        return kl.view(student.shape[:-1])

    @staticmethod
    def backward(ctx, grad_kl):
        student, log_p, owned, local, saved, kl = ctx.saved_tensors
        rows = as_rows(student)
        grad = torch.empty_like(rows)
        g = grad_kl.reshape(-1).float() * ctx.inv_t
        p = log_p.exp()
        for piece in row_slices(rows.shape[0], ctx.rows_per_chunk):
            if ctx.reverse:
                log_r = saved[piece]
                at_ids = finite_or_zero(log_r - log_p[piece] - kl[piece].unsqueeze(-1), log_r.exp())
                d = torch.zeros(rows[piece].shape, dtype=torch.float32, device=rows.device)
            else:
                d = torch.exp(rows[piece].float() * ctx.inv_t - saved[piece])
                at_ids = -p[piece]
            d.scatter_add_(-1, local[piece], at_ids * owned[piece])
            grad[piece] = (d * g[piece].unsqueeze(-1)).to(grad.dtype)
        return grad.view(student.shape), None, None, None, None, None, None


def topk_kl_divergence(student_logits: torch.Tensor, teacher_values: torch.Tensor, teacher_indices: torch.Tensor, *,
                       direction: str = "forward", shard: VocabShard | None = None, temperature: float = 1.0,
                       chunk_size: int | None = None) -> torch.Tensor:
    """``[...]`` fp32 per-token KL between a teacher given by its top-k logits ``teacher_values [..., k]`` at the
    global vocabulary ids ``teacher_indices [..., k]`` (distinct per row) and the student's vocab-split logits
    ``student_logits [..., V_padded/tp]`` (see the module docstring for what each ``direction`` means on a top-k
    support). Differentiable with respect to the student only.

    Collectives (over ``shard.group``): forward (``"forward"`` only) one all-reduce MAX of ``[tokens]``, then one
    all-reduce SUM of ``[tokens, k + 1]``; backward none."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if teacher_values.shape != teacher_indices.shape or teacher_values.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"teacher values {tuple(teacher_values.shape)} and indices {tuple(teacher_indices.shape)} "
                         f"must both be [..., k] over the student's tokens {tuple(student_logits.shape[:-1])}")
    rows = chunk_rows(teacher_values[..., 0].numel(), student_logits.shape[-1], chunk_size)
    return _TopKDivergence.apply(student_logits, teacher_values.to(student_logits.device),
                                 teacher_indices.to(student_logits.device).long(), shard or VocabShard(),
                                 direction == "reverse", check_temperature(temperature), rows)
