"""Linear (LM head) + cross-entropy in row chunks, so the ``[rows, vocab]`` logits never exist at once.

``loss = cross_entropy(hidden @ weight.T + bias, labels)`` with the semantics of ``cross_entropy.py`` (label
smoothing, ignore_index, ``reduction`` "mean" or "sum", vocab-parallel via ``group``).

Layout: ``hidden`` ``[..., H]``, ``weight`` ``[V_local, H]`` (the ``nn.Linear``/``lm_head`` layout),
``bias`` ``[V_local]`` or ``None``, ``labels`` ``[...]`` int64. With ``group`` of size > 1 each rank holds the
vocab slice ``weight[rank * V_local:(rank + 1) * V_local]`` and the same full (replicated) ``hidden``/``labels``.

Forward, per chunk of ``chunk_size`` rows: ``logits_c = hidden_c @ weight.T + bias`` (input dtype), the
cross-entropy stats kernel, (vocab parallel: all-reduce MAX, then one all-reduce SUM per chunk, as in
``cross_entropy.py``), the loss, and at once the gradient kernel with the per-row scale the reduction implies
(1/count for "mean"), so ``dlogits_c`` feeds ``dhidden_c = dlogits_c @ weight`` and
``dweight += dlogits_c.T @ hidden_c`` (fp32 accumulator) before the chunk is freed. The peak extra memory is
one chunk of logits and its gradient instead of two full ``[rows, V]`` tensors (plus the ``[rows, H]`` hidden
grad and an fp32 ``[V_local, H]`` weight-grad accumulator). Precision note: in fp16/bf16 the stored hidden grad
is rounded before the backward scales it by the upstream grad, one rounding more than eager when that grad is
not a power of two (``loss.backward()`` passes 1.0; an fp16 loss scale is a power of two). Because the gradient
is formed in the forward, ``reduction="none"`` is not offered (its per-row upstream grads are unknown until
backward).

Backward: scales the stored grads by the (scalar) upstream grad. Vocab parallel: ``dhidden`` is a partial sum
over this rank's vocab slice, so backward runs **one all-reduce SUM of dhidden over the group** -- the same
collective a column-parallel linear's input does. Callers therefore pass the replicated hidden states directly,
without their own copy-to-tensor-parallel-region mapping. ``dweight``/``dbias`` are local (no collective).

The default ``chunk_size`` makes one chunk of logits about as large as ``hidden`` (``rows * H / V_local``); on CUDA
it is at least ``CUDA_MIN_CHUNK_LOGITS / V_local`` rows (32 Mi logits, 64 MiB in bf16). Without that floor a large
vocabulary gives chunks of a few dozen rows: measured on an H200 (bf16, 8192 rows, H 768, V 128256) the op took
108 ms against 11 ms for eager torch, nearly all of it in 167 tiny matmuls and as many ``[V, H]`` weight-grad
additions. On CUDA the weight grad is also accumulated by ``addmm`` with an fp32 output straight into the fp32
buffer (no ``[V, H]`` half-precision temporary per chunk).

``linear_cross_entropy_loss`` is the form the models' LM/MLM heads call (``skip_logits=True``): always chunked,
on any device (the Triton kernels where the dispatcher picks them, the torch stats/grad functions elsewhere), fp32
loss, and a vocabulary padded to a multiple of the group size (``vocab_size``: padding rows are cut off, so each
rank passes its own first id and the real total; the last rank's slice may be shorter or empty).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from oslo_models.fused_ops.cross_entropy import (
    _grad_torch,
    _stats_torch,
    check_args,
    combine_stats,
    cross_entropy_reference,
    vocab_range,
)
from oslo_models.fused_ops.dispatch import use_triton

CUDA_MIN_CHUNK_LOGITS = 1 << 25


def default_chunk_size(n_rows: int, hidden: int, local_vocab: int, device: torch.device | None = None) -> int:
    """Rows per chunk: one chunk of logits about the size of ``hidden``, and on CUDA at least 32 Mi logits."""
    rows = math.ceil(n_rows * hidden / max(local_vocab, 1))
    if device is not None and device.type == "cuda":
        rows = max(rows, math.ceil(CUDA_MIN_CHUNK_LOGITS / max(local_vocab, 1)))
    return max(1, min(n_rows, rows))


def _accumulate_weight_grad(dweight: torch.Tensor, dlogits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``dweight += dlogits.T @ hidden`` into the fp32 buffer. fp32 inputs: ``addmm_``. Half inputs on CUDA: cuBLAS
    writes the fp32 sum directly (``out_dtype``); elsewhere a half-precision product, then an fp32 add."""
    if dlogits.dtype == torch.float32:
        dweight.addmm_(dlogits.t(), hidden)
    elif dweight.is_cuda:
        torch.addmm(dweight, dlogits.t(), hidden, out_dtype=torch.float32, out=dweight)
    else:
        dweight += dlogits.t() @ hidden


def _vocab_parallel(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _apply_outside_autocast(hidden2, weight, bias, *args):
    """``FusedLinearCrossEntropyFunction.apply`` with autocast's semantics for the head matmul: under autocast the
    hidden states, weight and bias are cast to the autocast dtype first (as ``nn.Linear`` would be, so the fp32
    master weight gets its gradient through the cast) and the chunks run with autocast off, so every chunk tensor
    has one dtype (autocast would otherwise give bf16 logits against an fp32 hidden-grad buffer)."""
    device_type = hidden2.device.type
    if not torch.is_autocast_enabled(device_type):
        return FusedLinearCrossEntropyFunction.apply(hidden2, weight, bias, *args)
    dtype = torch.get_autocast_dtype(device_type)
    hidden2, weight, bias = (None if t is None else t.to(dtype) for t in (hidden2, weight, bias))
    with torch.autocast(device_type, enabled=False):
        return FusedLinearCrossEntropyFunction.apply(hidden2, weight, bias, *args)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked LM head + cross-entropy; returns the reduced fp32 loss. Grads are formed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, reduction, group, chunk_size,
                use_kernel, vocab=None):
        n_rows = hidden.shape[0]
        # ``vocab``: (first id of this rank's columns, full vocab size) when the caller passes a weight with the
        # vocabulary padding rows already cut off (unequal slices); equal slices otherwise.
        vocab_start, vocab_total = vocab if vocab is not None else vocab_range(weight.shape[0], group)
        count = (labels != ignore_index).sum()
        row_scale = torch.ones(n_rows, dtype=torch.float32, device=hidden.device)
        if reduction == "mean":
            row_scale = row_scale / count  # d(mean)/d(row loss); NaN grads when every row is ignored, as torch
        stats_fn = torch.ops.oslo_models.cross_entropy_stats if use_kernel else _stats_torch
        grad_fn = torch.ops.oslo_models.cross_entropy_backward if use_kernel else _grad_torch
        dhidden = torch.empty_like(hidden)
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        dbias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if bias is not None else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, n_rows))
            h, y = hidden[rows], labels[rows]
            logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
            stats = stats_fn(logits, y, vocab_start, ignore_index)
            loss_rows, lse = combine_stats(stats, y, vocab_total, label_smoothing, ignore_index, group)
            loss += loss_rows.sum()
            dlogits = grad_fn(logits, y, lse, row_scale[rows], vocab_start, vocab_total, label_smoothing,
                              ignore_index)
            del logits  # free the chunk's logits before the matmuls allocate
            torch.mm(dlogits, weight, out=dhidden[rows])
            _accumulate_weight_grad(dweight, dlogits, h)
            if dbias is not None:
                dbias += dlogits.sum(0, dtype=torch.float32)
        if reduction == "mean":
            loss = loss / count
        ctx.save_for_backward(dhidden, dweight, dbias)
        ctx.group = group
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dhidden, dweight, dbias = ctx.saved_tensors
        dhidden = dhidden * grad_loss.to(dhidden.dtype)  # a new tensor: safe to reduce in place
        if _vocab_parallel(ctx.group):
            dist.all_reduce(dhidden, op=dist.ReduceOp.SUM, group=ctx.group)
        # In place: a second [V, H] fp32 buffer would double this op's largest allocation (Liger does the same).
        # A second backward (retain_graph=True) then fails loudly: autograd sees the saved tensor was modified.
        dweight = dweight.mul_(grad_loss).to(ctx.dtypes[0])
        dbias = None if dbias is None else dbias.mul_(grad_loss).to(ctx.dtypes[1])
        return dhidden, dweight, dbias, None, None, None, None, None, None, None, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce SUM of the grad in backward (the reference's column-parallel input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def linear_cross_entropy_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                              bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                              reduction: str = "mean", group: Optional[dist.ProcessGroup] = None,
                              vocab_size: Optional[int] = None, chunk_size: Optional[int] = None,
                              enabled: bool = True, force_triton: bool = False) -> torch.Tensor:
    """The LM-head loss the models use: always chunked (no ``[rows, V]`` logits, on any device), with the Triton
    stats/grad kernels where the dispatcher picks them and the same math in torch elsewhere. Returns the fp32
    loss (as ``transformers``, which upcasts the logits before its cross-entropy).

    ``weight`` is this rank's ``[V_padded/tp, H]`` slice of a vocabulary padded up to a multiple of the group
    size; ``vocab_size`` (the real size) cuts the padding rows off, so they get no probability mass and no
    gradient (without it every row is a real id). Collectives as ``FusedLinearCrossEntropyFunction``: forward
    all-reduce MAX and SUM per chunk, backward one all-reduce SUM of the hidden grad.
    """
    check_args(hidden.shape, labels, 0.0, reduction, "linear_cross_entropy_loss")
    if reduction == "none":
        raise ValueError("linear_cross_entropy_loss: reduction must be 'mean' or 'sum'")
    local = weight.shape[0]
    vocab_start, vocab_total = vocab_range(local, group)
    if vocab_size is not None:
        if not vocab_total - local < vocab_size <= vocab_total:
            raise ValueError(f"linear_cross_entropy_loss: vocab_size={vocab_size} does not fit {local} rows "
                             f"per rank")
        num_real = max(0, min(local, vocab_size - vocab_start))
        if num_real < local:  # a view: the padding rows' grads are zero, as when masked to -inf
            weight = weight[:num_real]
            bias = None if bias is None else bias[:num_real]
        vocab_total = vocab_size
    hidden2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    labels1 = labels.reshape(-1).long()
    chunk = chunk_size or default_chunk_size(hidden2.shape[0], hidden2.shape[1], max(local, 1), hidden2.device)
    use_kernel = use_triton(hidden, weight, bias, labels, enabled=enabled, force_triton=force_triton)
    return _apply_outside_autocast(hidden2, weight, bias, labels1, ignore_index, 0.0, reduction, group, chunk,
                                   use_kernel, (vocab_start, vocab_total))


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                         label_smoothing: float = 0.0, reduction: str = "mean",
                                         group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Plain torch with full logits: ``cross_entropy_reference(F.linear(hidden, weight, bias), labels)``."""
    if _vocab_parallel(group):
        hidden = _CopyToGroup.apply(hidden, group)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_reference(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   reduction=reduction, group=group)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean",
                               group: Optional[dist.ProcessGroup] = None, chunk_size: Optional[int] = None,
                               enabled: bool = True, force_triton: bool = False) -> torch.Tensor:
    """Loss of ``F.linear(hidden, weight, bias)`` against ``labels`` without full logits; see module docstring."""
    check_args(hidden.shape, labels, label_smoothing, reduction, "fused_linear_cross_entropy")
    if reduction == "none":
        raise ValueError("fused_linear_cross_entropy: reduction='none' is not supported (grads are formed in "
                         "the forward); use 'mean' or 'sum', or cross_entropy on explicit logits")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"fused_linear_cross_entropy: weight must be [vocab, {hidden.shape[-1]}], "
                         f"got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"fused_linear_cross_entropy: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if not use_triton(hidden, weight, bias, labels, enabled=enabled, force_triton=force_triton):
        return fused_linear_cross_entropy_reference(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                                                    label_smoothing=label_smoothing, reduction=reduction,
                                                    group=group)
    hidden2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    labels1 = labels.reshape(-1).long()
    chunk = chunk_size or default_chunk_size(hidden2.shape[0], hidden2.shape[1], weight.shape[0], hidden2.device)
    loss = _apply_outside_autocast(hidden2, weight, bias, labels1, ignore_index, float(label_smoothing), reduction,
                                   group, chunk, True)
    return loss.to(hidden.dtype)
