"""KL divergence between a student and a teacher over the whole vocabulary, both as vocab-split logits.

With ``s = student / T`` and ``t = teacher / T`` (fp32) of this rank's columns, ``p = softmax(t)``, ``q = softmax(s)``:

    forward KL(p || q) = sum p (log p - log q) = A_t / S_t - lse_t + lse_s,   A_t = sum e_t (t - s)
    reverse KL(q || p) = sum q (log q - log p) = A_s / S_s - lse_s + lse_t,   A_s = sum e_s (s - t)

    forward:  [m_s, m_t] = all-reduce MAX of the row maxima                   (one [2, tokens] all-reduce)
              [S_s, S_t, A] = all-reduce SUM, e = exp(. - m)                  (one [3, tokens] all-reduce)
    backward (student only; the teacher is a constant):
              forward KL: dKL/ds = q - p;  reverse KL: dKL/ds = q (log q - log p - KL)      (local: no collective)

Both models' logits must be split the same way (the same tensor-parallel size and padded vocabulary: the padded
columns are ``-inf`` in both, so they hold no mass). A teacher at another layout gives its top-k instead
(``topk_divergence.py``). TRL's ``DistillationTrainer`` uses the same definitions (``beta=0``: forward, ``beta=1``:
reverse, ``temperature`` on both sides, no ``T^2`` factor).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .vocab_shard import VocabShard, as_rows, check_temperature, chunk_rows, finite_or_zero, row_slices

DIRECTIONS = ("forward", "reverse")


class _KLDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, shard: VocabShard, reverse: bool, temperature: float, rows_per_chunk: int):
        s_rows, t_rows = as_rows(student), as_rows(teacher.detach())
        num_rows = s_rows.shape[0]
        inv_t = 1.0 / temperature
        chunks = row_slices(num_rows, rows_per_chunk)
        device = s_rows.device
        maxes = torch.full((2, num_rows), -math.inf, device=device)
        for piece in chunks:
            maxes[0, piece] = (s_rows[piece].float() * inv_t).amax(-1)
            maxes[1, piece] = (t_rows[piece].float() * inv_t).amax(-1)
        shard.all_reduce(maxes, dist.ReduceOp.MAX)
        sums = torch.zeros(3, num_rows, device=device)
        for piece in chunks:
            s = s_rows[piece].float() * inv_t
            t = t_rows[piece].float() * inv_t
            e_s = torch.exp(s - maxes[0, piece].unsqueeze(-1))
            e_t = torch.exp(t - maxes[1, piece].unsqueeze(-1))
            sums[0, piece], sums[1, piece] = e_s.sum(-1), e_t.sum(-1)
            sums[2, piece] = finite_or_zero(s - t, e_s).sum(-1) if reverse else finite_or_zero(t - s, e_t).sum(-1)
        shard.all_reduce(sums)
        lse_s, lse_t = maxes[0] + sums[0].log(), maxes[1] + sums[1].log()
        if reverse:
            kl = sums[2] / sums[0] - lse_s + lse_t
        else:
            kl = sums[2] / sums[1] - lse_t + lse_s
        ctx.save_for_backward(student, teacher.detach(), lse_s, lse_t, kl)
        ctx.reverse, ctx.inv_t, ctx.rows_per_chunk = reverse, inv_t, rows_per_chunk
        return kl.view(student.shape[:-1])

    @staticmethod
    def backward(ctx, grad_kl):
        student, teacher, lse_s, lse_t, kl = ctx.saved_tensors
        s_rows, t_rows = as_rows(student), as_rows(teacher)
        grad = torch.empty_like(s_rows)
        g = grad_kl.reshape(-1).float()
        for piece in row_slices(s_rows.shape[0], ctx.rows_per_chunk):
            log_q = s_rows[piece].float() * ctx.inv_t - lse_s[piece].unsqueeze(-1)
            log_p = t_rows[piece].float() * ctx.inv_t - lse_t[piece].unsqueeze(-1)
            q = torch.exp(log_q)
            if ctx.reverse:
                d = finite_or_zero(log_q - log_p - kl[piece].unsqueeze(-1), q)
            else:
                d = q - torch.exp(log_p)
            grad[piece] = (d * (g[piece] * ctx.inv_t).unsqueeze(-1)).to(grad.dtype)
        return grad.view(student.shape), None, None, None, None, None


def kl_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, direction: str = "forward",
                  shard: VocabShard | None = None, temperature: float = 1.0,
                  chunk_size: int | None = None) -> torch.Tensor:
    """``[...]`` fp32 per-token KL between the softmaxes of ``student_logits`` and ``teacher_logits`` (both
    ``[..., V_padded/tp]``, split alike) divided by ``temperature``: ``direction="forward"`` is KL(teacher ||
    student), ``"reverse"`` KL(student || teacher). Differentiable with respect to the student only.

    Collectives (over ``shard.group``): forward one all-reduce MAX of ``[2, tokens]`` and one all-reduce SUM of
    ``[3, tokens]``; backward none. Every position is scored: multiply by your mask."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the two must cover the same tokens and the same "
                         "vocabulary split (a teacher at another layout: use topk_kl_divergence)")
    rows = chunk_rows(student_logits[..., 0].numel(), student_logits.shape[-1], chunk_size)
    return _KLDivergence.apply(student_logits, teacher_logits.to(student_logits.device), shard or VocabShard(),
                               direction == "reverse", check_temperature(temperature), rows)
