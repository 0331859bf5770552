"""RMSNorm (Llama/T5 style) over the last dimension: forward and backward (input and weight grads) in Triton.

``y = weight * x / sqrt(mean(x**2) + eps)``.

Layout: ``x`` is ``[..., hidden]`` (any hidden size, fp32/fp16/bf16), ``weight`` is ``[hidden]``. The output has
``x``'s shape and the promoted dtype of ``x`` and ``weight``, as ``LlamaRMSNorm`` returns. The kernel works in
fp32 and rounds once on the store; ``LlamaRMSNorm`` also rounds the normalized value to ``x``'s dtype before
the weight multiply, so in bf16 the kernel is the more accurate of the two (identical in fp32).

As in ``layer_norm.py`` the backward recomputes 1/rms from the row of ``x`` it loads anyway, and the weight
grad is summed as per-program fp32 partials, then on the host.
"""
from __future__ import annotations

import torch
from torch import nn

from oslo_models.fused_ops._utils import as_rows, num_reduction_programs, row_block_settings, tl, triton
from oslo_models.fused_ops.dispatch import use_triton


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = x * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, num_progs):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        xhat = x * rstd
        g = dy * w
        # d/dx of x * rstd applied to g: rstd * (g - xhat * mean(g * xhat))
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
    tl.store(dw_part_ptr + pid * n_cols + cols, dw_acc, mask=mask)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launch the forward kernel: one program per row."""
    x2 = as_rows(x)
    y = torch.empty(x2.shape, dtype=_out_dtype(x, weight), device=x.device)
    block, num_warps = row_block_settings(x2.shape[1], "rms_norm")
    if x2.shape[0] > 0:
        _rms_norm_fwd_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, x2.shape[1], eps, BLOCK=block,
                                             num_warps=num_warps)
    return y.view(x.shape)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns (dx in x's dtype, dweight in weight's dtype)."""
    x2, dy2 = as_rows(x), as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    progs = num_reduction_programs(x.device, n_rows)
    dw_part = torch.zeros(progs, n_cols, dtype=torch.float32, device=x.device)
    block, num_warps = row_block_settings(n_cols, "rms_norm")
    if n_rows > 0:
        _rms_norm_bwd_kernel[(progs,)](dy2, x2, weight.contiguous(), dx, dw_part, n_rows, n_cols, eps,
                                       BLOCK=block, num_warps=num_warps)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


@torch.library.custom_op("oslo_models::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_forward(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)


@torch.library.custom_op("oslo_models::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(dy, x, weight, eps)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight)


def _save_for_backward(ctx, inputs, output):
    x, weight, ctx.eps = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, dy):
    dx, dw = torch.ops.oslo_models.rms_norm_backward(dy, *ctx.saved_tensors, ctx.eps)
    return dx, dw, None


torch.library.register_autograd("oslo_models::rms_norm", _backward, setup_context=_save_for_backward)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch, the ``LlamaRMSNorm`` formula: normalize in fp32, round to ``x``'s dtype, scale by weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, enabled: bool = True,
             force_triton: bool = False) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., hidden]`` with ``weight`` ``[hidden]``; see ``dispatch.use_triton``."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if use_triton(x, weight, enabled=enabled, force_triton=force_triton):
        return torch.ops.oslo_models.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


class FusedRMSNorm(nn.Module):
    """``LlamaRMSNorm``-compatible module: ``FusedRMSNorm(hidden_size, eps)``, state-dict key ``weight``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, fused_ops: bool = True, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.fused_ops = fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, enabled=self.fused_ops)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
