"""Cross-entropy over logits split by vocabulary across the tensor-parallel group.

The full ``[tokens, vocab]`` logits never exist on one rank. Per token, with ``z`` this rank's logits:

    forward:  m = all-reduce MAX of max(z)            (a shift for stability; not differentiated)
              S = all-reduce SUM of sum(exp(z - m))
              t = all-reduce SUM of (z[label] - m) on the rank that owns ``label``, 0 elsewhere
              loss = log(S) - t
    backward: dz = softmax(z) - onehot(label)         (local; no collective)

Padded vocabulary columns must hold ``-inf`` (``ColumnParallelLinear`` masks them), so they get no mass.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import group_size


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, ignore_index):
        logits = logits.float()
        row_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)

        num_local = logits.shape[-1]
        local_labels = labels - vocab_start
        valid = labels != ignore_index
        owned = valid & (local_labels >= 0) & (local_labels < num_local)
        safe_labels = local_labels.clamp(0, num_local - 1)
        target = torch.gather(shifted, -1, safe_labels.unsqueeze(-1)).squeeze(-1)
        target = _all_reduce(torch.where(owned, target, torch.zeros_like(target)), group)

        loss = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), safe_labels, owned, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_labels, owned, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, safe_labels.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid.to(grad_loss.dtype)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, group, vocab_start: int,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32, 0 where ``labels == ignore_index``) from local logits ``[..., vocab/tp]``.

    ``vocab_start`` is the first vocabulary id this rank's columns hold. Forward: three all-reduces (max, sum of
    exponentials, target logit). Backward: none. The returned gradient has the logits' dtype.

    Under the 2D / 2.5D modes ``group`` is the head's ``Grid``: ``logits`` are this rank's block of the tokens
    (the batch is split over the grid's columns and depth) while ``labels`` cover the whole batch. The loss of
    this rank's tokens is computed over the row (the vocabulary group) and all-gathered over the batch groups
    (backward: split), so callers reduce the global batch exactly as at 1D.
    """
    # the isinstance test first: torch.compile refuses attribute probes on a ProcessGroup (an opaque object)
    if group is not None and not isinstance(group, dist.ProcessGroup) and hasattr(group, "vocab_group"):
        local = _VocabParallelCrossEntropy.apply(logits, group.local_rows(labels), vocab_start, group.vocab_group,
                                                 ignore_index)
        return group.gather_rows(local)
    loss = _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, group, ignore_index)
    return loss


def causal_lm_loss(local_logits: torch.Tensor, labels: torch.Tensor | None, *, group, vocab_start: int,
                   ignore_index: int = -100, num_items_in_batch=None,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """``transformers``' causal-LM loss on vocab-split logits: labels shifted left, mean over non-ignored tokens
    (or sum / ``num_items_in_batch`` when given, as ``transformers`` does for gradient accumulation).

    ``shift_labels`` (``[b, s]``, already aligned with the logits: position ``t`` holds the target of ``t``) is
    used as is instead of shifting ``labels``, as ``transformers``' ``ForCausalLMLoss`` does; context parallelism
    needs it, because a rank's chunk of the sequence cannot see the next chunk's first token."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    labels = shift_labels.to(local_logits.device)
    per_token = vocab_parallel_cross_entropy(local_logits.reshape(-1, local_logits.shape[-1]), labels.reshape(-1),
                                             group=group, vocab_start=vocab_start, ignore_index=ignore_index)
    total = per_token.sum()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (labels != ignore_index).sum()
