"""Cross-entropy over logits, with label smoothing and ignore_index, single-device or vocab-parallel.

Layout: ``logits`` ``[..., vocab]`` (fp32/fp16/bf16), ``labels`` ``[...]`` int64 (the same leading shape).
Per row (fp32): ``loss = lse - (1 - eps) * x[label] - (eps / V) * sum_j x[j]`` with ``lse = logsumexp(x)``, which
is ``F.cross_entropy(..., label_smoothing=eps)``; rows whose label is ``ignore_index`` give 0 and no gradient.
``reduction="mean"`` divides by the number of non-ignored rows (NaN if there are none, like torch). The loss is
returned in the logits' dtype, as torch does.

Vocab parallel (``group`` is a process group of size > 1): each rank holds its slice of the vocab,
``logits[..., rank * V_local:(rank + 1) * V_local]`` (equal slices, ``V = V_local * world_size``), and the same
full ``labels``. Forward, per row: a Triton pass over the local slice gives (max, sum exp(x - max), x[label] if
the label falls in this slice else 0, sum x); then

- all-reduce MAX of the row max,
- rescale the local sum-exp to the global max, then one all-reduce SUM of (sum-exp, target logit, sum x)
  packed into one ``[3, rows]`` tensor.

Every rank then holds the full per-row loss. Backward: ``dlogits = g * (softmax(x) - (1 - eps) * onehot - eps/V)``
on the local slice from the saved global ``lse``; it needs **no collective**. The same math runs in plain torch
when the Triton path is off, so CPU tensor-parallel training works without kernels.

The stats and gradient kernels are registered as ``oslo_models::cross_entropy_stats`` and
``oslo_models::cross_entropy_backward``; the collectives sit between them in ``CrossEntropyFunction``, which is
why this op uses an ``autograd.Function`` rather than ``register_autograd``. ``fused_linear_cross_entropy``
reuses both kernels and ``combine_stats``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from oslo_models.fused_ops._utils import LOOP_BLOCK, next_power_of_2, tl, triton
from oslo_models.fused_ops.dispatch import use_triton

_REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _ce_stats_kernel(logits_ptr, labels_ptr, stats_ptr, n_rows, n_cols, row_stride, vocab_start, ignore_index,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    row_max = float("-inf")
    sum_exp = 0.0
    sum_x = 0.0
    for start in range(0, n_cols, BLOCK):  # online logsumexp: one read of the row, any vocab size
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: avoid -inf - -inf
        sum_exp = sum_exp * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        row_max = new_max
        sum_x += tl.sum(tl.where(valid, x, 0.0), axis=0)
    local = label - vocab_start
    hit = (local >= 0) & (local < n_cols) & (label != ignore_index)
    target = tl.load(base + tl.where(hit, local, 0), mask=hit, other=0.0).to(tl.float32)
    tl.store(stats_ptr + row, row_max)
    tl.store(stats_ptr + n_rows + row, sum_exp)
    tl.store(stats_ptr + 2 * n_rows + row, tl.where(hit, target, 0.0))
    tl.store(stats_ptr + 3 * n_rows + row, sum_x)


@triton.jit
def _ce_bwd_kernel(logits_ptr, labels_ptr, lse_ptr, grad_ptr, dlogits_ptr, n_cols, row_stride, vocab_start,
                   ignore_index, target_weight, uniform_weight, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.where(label == ignore_index, 0.0, tl.load(grad_ptr + row))
    local = label - vocab_start
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=0.0).to(tl.float32)
        dx = (tl.exp(x - lse) - uniform_weight - tl.where(cols == local, target_weight, 0.0)) * g
        tl.store(dlogits_ptr + row * n_cols + cols, dx.to(dlogits_ptr.dtype.element_ty), mask=valid)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    # The kernels address rows through a stride, so a row-sliced view needs no copy; the vocab dim must be dense.
    logits = logits.reshape(-1, logits.shape[-1])
    return logits if logits.stride(-1) == 1 else logits.contiguous()


@torch.library.custom_op("oslo_models::cross_entropy_stats", mutates_args=())
def _ce_stats_op(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int) -> torch.Tensor:
    """``[4, rows]`` fp32: row max, sum exp(x - max), target logit (0 off-slice or ignored), sum x."""
    logits = _rows(logits)
    n_rows, n_cols = logits.shape
    stats = torch.empty(4, n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        _ce_stats_kernel[(n_rows,)](logits, labels.contiguous(), stats, n_rows, n_cols, logits.stride(0),
                                    vocab_start, ignore_index, BLOCK=min(LOOP_BLOCK, next_power_of_2(n_cols)))
    return stats


@_ce_stats_op.register_fake
def _(logits, labels, vocab_start, ignore_index):
    return logits.new_empty(4, logits.numel() // logits.shape[-1], dtype=torch.float32)


@torch.library.custom_op("oslo_models::cross_entropy_backward", mutates_args=())
def _ce_backward_op(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad_rows: torch.Tensor,
                    vocab_start: int, vocab_total: int, label_smoothing: float, ignore_index: int) -> torch.Tensor:
    """``dlogits`` ``[rows, V_local]`` in the logits dtype for per-row upstream grads ``grad_rows`` (fp32)."""
    logits = _rows(logits)
    n_rows, n_cols = logits.shape
    dlogits = torch.empty(n_rows, n_cols, dtype=logits.dtype, device=logits.device)
    if n_rows:
        _ce_bwd_kernel[(n_rows,)](logits, labels.contiguous(), lse.contiguous(), grad_rows.float().contiguous(),
                                  dlogits, n_cols, logits.stride(0), vocab_start, ignore_index,
                                  1.0 - label_smoothing, label_smoothing / vocab_total,
                                  BLOCK=min(LOOP_BLOCK, next_power_of_2(n_cols)))
    return dlogits


@_ce_backward_op.register_fake
def _(logits, labels, lse, grad_rows, vocab_start, vocab_total, label_smoothing, ignore_index):
    return logits.new_empty(logits.numel() // logits.shape[-1], logits.shape[-1])


def _stats_torch(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int) -> torch.Tensor:
    """The stats kernel's output, in plain torch (the reference path of the vocab-parallel form)."""
    x = logits.float()
    if x.shape[1] == 0:  # a rank whose vocabulary slice is all padding: no mass, no target
        zeros = x.new_zeros(x.shape[0])
        return torch.stack([torch.full_like(zeros, float("-inf")), zeros, zeros, zeros])
    row_max = x.max(-1).values
    sum_exp = torch.exp(x - row_max.where(torch.isfinite(row_max), 0.0)[:, None]).sum(-1)
    local = labels - vocab_start
    hit = (local >= 0) & (local < x.shape[1]) & (labels != ignore_index)
    target = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0].where(hit, 0.0)
    return torch.stack([row_max, sum_exp, target, x.sum(-1)])


def _grad_torch(logits, labels, lse, grad_rows, vocab_start, vocab_total, label_smoothing, ignore_index):
    """The backward kernel's output, in plain torch."""
    probs = torch.exp(logits.float() - lse[:, None])
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == (labels - vocab_start)[:, None]
    g = grad_rows.float().where(labels != ignore_index, 0.0)[:, None]
    dx = (probs - label_smoothing / vocab_total - onehot * (1.0 - label_smoothing)) * g
    return dx.to(logits.dtype)


def vocab_range(local_vocab: int, group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(first vocab id of this rank's slice, full vocab size) for equal slices over ``group``."""
    if group is None or dist.get_world_size(group) == 1:
        return 0, local_vocab
    return dist.get_rank(group) * local_vocab, local_vocab * dist.get_world_size(group)


def combine_stats(stats: torch.Tensor, labels: torch.Tensor, vocab_total: int, label_smoothing: float,
                  ignore_index: int, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(loss, lse)`` in fp32 from local stats; all-reduces over ``group`` (see module docstring)."""
    row_max, sum_exp, target, sum_x = stats.unbind(0)
    if group is not None and dist.get_world_size(group) > 1:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        shift = global_max.where(torch.isfinite(global_max), 0.0)
        packed = torch.stack([sum_exp * torch.exp(row_max - shift), target, sum_x])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        row_max, (sum_exp, target, sum_x) = global_max, packed.unbind(0)
    lse = row_max.where(torch.isfinite(row_max), 0.0) + torch.log(sum_exp)
    loss = lse - (1.0 - label_smoothing) * target - (label_smoothing / vocab_total) * sum_x
    return loss.where(labels != ignore_index, 0.0), lse


class CrossEntropyFunction(torch.autograd.Function):
    """Per-row losses (fp32) of ``logits`` ``[rows, V_local]``; Triton or torch stats/grad, same collectives."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index, label_smoothing, group, use_kernel):
        vocab_start, vocab_total = vocab_range(logits.shape[1], group)
        if use_kernel:
            stats = torch.ops.oslo_models.cross_entropy_stats(logits, labels, vocab_start, ignore_index)
        else:
            stats = _stats_torch(logits, labels, vocab_start, ignore_index)
        loss, lse = combine_stats(stats, labels, vocab_total, label_smoothing, ignore_index, group)
        ctx.save_for_backward(logits, labels, lse)
        ctx.args = (vocab_start, vocab_total, label_smoothing, ignore_index)
        ctx.use_kernel = use_kernel
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        grad_fn = torch.ops.oslo_models.cross_entropy_backward if ctx.use_kernel else _grad_torch
        return grad_fn(logits, labels, lse, grad_loss, *ctx.args), None, None, None, None, None


def reduce_loss(loss_rows: torch.Tensor, labels: torch.Tensor, reduction: str, ignore_index: int) -> torch.Tensor:
    """Apply ``reduction`` to fp32 per-row losses the way ``F.cross_entropy`` does."""
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / (labels != ignore_index).sum()


def check_args(logits_shape, labels: torch.Tensor, label_smoothing: float, reduction: str, op: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if tuple(labels.shape) != tuple(logits_shape[:-1]):
        raise ValueError(f"{op}: labels shape {tuple(labels.shape)} does not match logits rows "
                         f"{tuple(logits_shape[:-1])}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: labels must be int64 or int32, got {labels.dtype}")


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                            label_smoothing: float = 0.0, reduction: str = "mean",
                            group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Plain torch: ``F.cross_entropy`` on one device; the same stats/collectives math in torch with a group."""
    if group is None or dist.get_world_size(group) == 1:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=ignore_index, label_smoothing=label_smoothing,
                                                 reduction=reduction).reshape(
            labels.shape if reduction == "none" else ())
    labels1 = labels.reshape(-1).long()
    rows = CrossEntropyFunction.apply(_rows(logits), labels1, ignore_index, label_smoothing, group, False)
    return reduce_loss(rows, labels1, reduction, ignore_index).reshape(
        labels.shape if reduction == "none" else ()).to(logits.dtype)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean",
                  group: Optional[dist.ProcessGroup] = None, enabled: bool = True,
                  force_triton: bool = False) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``[..., V or V_local]`` against ``labels`` ``[...]``; see module docstring."""
    check_args(logits.shape, labels, label_smoothing, reduction, "cross_entropy")
    if not use_triton(logits, labels, enabled=enabled, force_triton=force_triton):
        return cross_entropy_reference(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                       reduction=reduction, group=group)
    labels1 = labels.reshape(-1).long()
    rows = CrossEntropyFunction.apply(_rows(logits), labels1, ignore_index, float(label_smoothing), group, True)
    loss = reduce_loss(rows, labels1, reduction, ignore_index)
    return loss.reshape(labels.shape if reduction == "none" else ()).to(logits.dtype)
