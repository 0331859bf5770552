"""``residual + dropout(x + bias, p)`` in one pass, forward and backward in Triton.

Layout: ``x`` and ``residual`` are ``[..., hidden]`` with the same shape and dtype, ``bias`` is ``[hidden]`` or
``None``. The output has ``x``'s shape and dtype; math in fp32, one rounding on the store.

RNG: the keep mask is never stored. The forward draws one int64 ``seed`` from torch's generator for ``x``'s
device (so ``torch.manual_seed``, a ``generator=`` argument or a per-rank RNG tracker controls it) and keeps
element ``i`` iff ``philox(seed, i) >= p``. The backward kernel regenerates exactly the same mask from the same
seed and element index, so the gradient always uses the forward's mask at the cost of 8 bytes of saved state
instead of a mask the size of ``x``. The seed stays a device tensor, so there is no host sync.

This mask stream is Triton's Philox, not torch's: for the same seed the kernel and ``torch.nn.functional.dropout``
drop different elements (same distribution). ``bias_dropout_add_reference`` therefore takes an explicit ``mask``
for exact comparisons.

Gradients: ``dx = dy * keep / (1 - p)``, ``dbias = sum_rows(dx)``, ``dresidual = dy``.
"""
from __future__ import annotations

from typing import Optional

import torch

from oslo_models.fused_ops._utils import ELEMENTWISE_BLOCK, bias_grad, tl, triton
from oslo_models.fused_ops.dispatch import use_triton


@triton.jit
def _keep_scale(seed_ptr, offs, p, scale):
    """Per-element multiplier: ``scale`` = 1/(1-p) where kept, 0 where dropped (recomputed in backward)."""
    keep = tl.rand(tl.load(seed_ptr), offs) >= p  # rand is in [0, 1): p = 1 drops everything
    return tl.where(keep, scale, 0.0)


@triton.jit
def _bias_dropout_add_fwd_kernel(x_ptr, b_ptr, r_ptr, seed_ptr, y_ptr, n_elements, n_cols, p, scale,
                                 HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = r + v * _keep_scale(seed_ptr, offs, p, scale)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_dropout_add_bwd_kernel(dy_ptr, seed_ptr, dx_ptr, n_elements, p, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (dy * _keep_scale(seed_ptr, offs, p, scale)).to(dx_ptr.dtype.element_ty), mask=mask)


def _keep_multiplier(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def bias_dropout_add_forward(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                             seed: torch.Tensor, p: float) -> torch.Tensor:
    x, residual = x.contiguous(), residual.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _bias_dropout_add_fwd_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](
            x, bias.contiguous() if bias is not None else x, residual, seed, y, n, x.shape[-1], p,
            _keep_multiplier(p), HAS_BIAS=bias is not None, BLOCK=ELEMENTWISE_BLOCK)
    return y


def bias_dropout_add_backward(dy: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    dy = dy.contiguous()
    dx = torch.empty_like(dy)
    n = dy.numel()
    if n:
        _bias_dropout_add_bwd_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](
            dy, seed, dx, n, p, _keep_multiplier(p), BLOCK=ELEMENTWISE_BLOCK)
    return dx


@torch.library.custom_op("oslo_models::bias_dropout_add", mutates_args=())
def _bias_dropout_add_op(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                         seed: torch.Tensor, p: float) -> torch.Tensor:
    return bias_dropout_add_forward(x, bias, residual, seed, p)


@_bias_dropout_add_op.register_fake
def _(x, bias, residual, seed, p):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("oslo_models::bias_dropout_add_backward", mutates_args=())
def _bias_dropout_add_backward_op(dy: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    return bias_dropout_add_backward(dy, seed, p)


@_bias_dropout_add_backward_op.register_fake
def _(dy, seed, p):
    return torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)


def _save_for_backward(ctx, inputs, output):
    """Saves only the seed: the mask is regenerated in the backward."""
    x, bias, residual, seed, ctx.p = inputs
    ctx.save_for_backward(seed)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy):
    dx = torch.ops.oslo_models.bias_dropout_add_backward(dy, *ctx.saved_tensors, ctx.p)
    return dx, bias_grad(dx, ctx.bias_dtype), dy, None, None


torch.library.register_autograd("oslo_models::bias_dropout_add", _backward, setup_context=_save_for_backward)


def bias_dropout_add_reference(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                               training: bool = True, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch. With ``mask`` (bool, True = keep) the dropout uses that mask instead of drawing one."""
    v = x if bias is None else x + bias
    if mask is None:
        return residual + torch.nn.functional.dropout(v, p, training)
    if not training or p == 0.0:
        return residual + v
    return residual + v * mask / (1.0 - p) if p < 1.0 else residual + v * 0.0


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool = True, *, generator: Optional[torch.Generator] = None, enabled: bool = True,
                     force_triton: bool = False) -> torch.Tensor:
    """``residual + dropout(x + bias, p if training else 0)``; see the module docstring for the RNG."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: dropout probability must be in [0, 1], got {p}")
    if residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias_dropout_add: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")
    if not use_triton(x, bias, residual, enabled=enabled, force_triton=force_triton):
        return bias_dropout_add_reference(x, bias, residual, p, training)
    p = float(p) if training else 0.0
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=x.device, generator=generator)
    return torch.ops.oslo_models.bias_dropout_add(x, bias, residual, seed, p)
