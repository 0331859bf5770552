"""LayerNorm over the last dimension: forward and backward (input, weight and bias grads) in Triton.

Layout: ``x`` is ``[..., hidden]`` (any leading dims, any hidden size, fp32/fp16/bf16); ``weight`` and ``bias``
are ``[hidden]``. The output has the shape and dtype of ``x``. Statistics and the affine transform are computed
in fp32 and rounded once on the store.

The forward kernel saves nothing: the backward kernel reloads the row of ``x`` it needs anyway and recomputes
mean and 1/std in registers, which costs no extra memory traffic and keeps the op a single-output custom op.
Weight/bias grads are summed in two stages: each backward program walks a strided set of rows and keeps fp32
partial sums in registers, then the ``[programs, hidden]`` partials are summed on the host (deterministic, no
atomics).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from oslo_models.fused_ops._utils import as_rows, num_reduction_programs, row_block_settings, tl, triton
from oslo_models.fused_ops.dispatch import env_forces, use_triton


@triton.jit
def _layer_norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n_cols, eps,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64 so row * n_cols cannot overflow on large activations
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)  # padded lanes must not enter the variance
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    y = xc * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, n_rows, n_cols, eps,
                           BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, num_progs):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        xhat = xc * rstd
        g = dy * w
        # d/dx of (x - mean) * rstd applied to g: rstd * (g - mean(g) - xhat * mean(g * xhat))
        dx = rstd * (g - tl.sum(g, axis=0) / n_cols - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(dw_part_ptr + pid * n_cols + cols, dw_acc, mask=mask)
    tl.store(db_part_ptr + pid * n_cols + cols, db_acc, mask=mask)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (bias is not None and bias.shape != (hidden,)):
        raise ValueError(f"layer_norm: weight/bias must have shape ({hidden},), got {tuple(weight.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       eps: float) -> torch.Tensor:
    """Launch the forward kernel: one program per row."""
    x2 = as_rows(x)
    y = torch.empty_like(x2)
    block, num_warps = row_block_settings(x2.shape[1], "layer_norm")
    if x2.shape[0] > 0:
        _layer_norm_fwd_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), bias.contiguous() if bias is not None else weight, y, x2.shape[1], eps,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=num_warps)
    return y.view(x.shape)


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns (dx, dweight, dbias) with dweight/dbias in the weight dtype."""
    x2, dy2 = as_rows(x), as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    progs = num_reduction_programs(x.device, n_rows)
    dw_part = torch.zeros(progs, n_cols, dtype=torch.float32, device=x.device)
    db_part = torch.zeros(progs, n_cols, dtype=torch.float32, device=x.device)
    block, num_warps = row_block_settings(n_cols, "layer_norm")
    if n_rows > 0:
        _layer_norm_bwd_kernel[(progs,)](dy2, x2, weight.contiguous(), dx, dw_part, db_part, n_rows, n_cols,
                                         eps, BLOCK=block, num_warps=num_warps)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)


@torch.library.custom_op("oslo_models::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return layer_norm_forward(x, weight, bias, eps)


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("oslo_models::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer_norm_backward(dy, x, weight, eps)


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, eps):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight),
            torch.empty_like(weight))


def _save_for_backward(ctx, inputs, output):
    x, weight, bias, ctx.eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    dx, dw, db = torch.ops.oslo_models.layer_norm_backward(dy, *ctx.saved_tensors, ctx.eps)
    return dx, dw, (db if ctx.has_bias else None), None


torch.library.register_autograd("oslo_models::layer_norm", _backward, setup_context=_save_for_backward)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         eps: float) -> torch.Tensor:
    """Plain torch: the same function as ``nn.LayerNorm`` over the last dim (computed in ``x``'s dtype)."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *,
               enabled: bool = True, force_triton: bool = False) -> torch.Tensor:
    """LayerNorm of ``x`` ``[..., hidden]`` with ``weight``/``bias`` ``[hidden]``.

    Unlike the other ops, ``enabled=True`` alone keeps torch's own kernel: ATen's LayerNorm is already one fused
    kernel per pass, and on an H200 (bf16, forward + backward, BENCHMARKS.md) it was 3-7x faster than this one at
    hidden <= 4096 (8192 x 768: 0.17 vs 1.24 ms) and tied at 32768 x 4096. The Triton kernel runs when forced
    (``force_triton=True`` or ``OSLO_FUSED_OPS=force``), which is how its tests reach it."""
    _check_inputs(x, weight, bias)
    if force_triton or (enabled and env_forces()):
        use_triton(x, weight, bias, force_triton=True)  # raises when the kernel cannot run here
        return torch.ops.oslo_models.layer_norm(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


class FusedLayerNorm(nn.LayerNorm):
    """Drop-in ``nn.LayerNorm`` (same constructor, same ``weight``/``bias`` state-dict keys) over the last dim.

    ``fused_ops`` is the model's switch (``ParallelConfig.fused_ops``); without an affine weight the module
    falls back to the reference, since the kernel always applies one.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, fused_ops: bool = True):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FusedLayerNorm normalizes the last dim only, got {self.normalized_shape}")
        self.fused_ops = fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps, enabled=self.fused_ops)
