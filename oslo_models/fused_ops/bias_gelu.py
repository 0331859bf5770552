"""``gelu(x + bias)`` in one pass, tanh approximation or exact erf form, forward and backward in Triton.

Layout: ``x`` is ``[..., hidden]`` (fp32/fp16/bf16), ``bias`` is ``[hidden]`` or ``None``. The output has ``x``'s
shape and dtype. Math is done in fp32, rounded once on the store.

- ``approximate="tanh"`` (GPT-2's ``gelu_new``): ``gelu(u) = u * sigmoid(2 k (u + 0.044715 u^3))`` with
  ``k = sqrt(2/pi)``; that is ``0.5 u (1 + tanh(k (u + 0.044715 u^3)))`` written with ``sigmoid`` because
  Triton has no portable ``tanh`` across versions and ``sigmoid`` is stable at both ends.
- ``approximate="none"`` (BERT's ``gelu``): ``gelu(u) = 0.5 u (1 + erf(u / sqrt(2)))``.

Backward recomputes ``u = x + bias`` rather than saving it: ``dx = dy * gelu'(u)`` in a Triton kernel, and
``dbias`` is the fp32 sum of ``dx`` over rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from oslo_models.fused_ops._utils import ELEMENTWISE_BLOCK, bias_grad, tl, triton
from oslo_models.fused_ops.dispatch import use_triton

_APPROXIMATIONS = ("tanh", "none")


@triton.jit
def _gelu_and_grad(u, TANH: tl.constexpr, WANT_GRAD: tl.constexpr):
    """gelu(u) if not WANT_GRAD else gelu'(u), in fp32."""
    if TANH:
        inner = 0.7978845608028654 * (u + 0.044715 * u * u * u)  # sqrt(2 / pi) * (...)
        # Clamp so exp never overflows; sigmoid(+-40) is already 1 / ~4e-18 in fp32.
        inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)
        s = tl.sigmoid(2.0 * inner)  # = 0.5 * (1 + tanh(inner))
        if WANT_GRAD:
            # d/du [u * s(2 inner)] = s + u * 2 s (1 - s) * k (1 + 3 * 0.044715 u^2)
            return s + u * 2.0 * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * u * u)
        return u * s
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
        if WANT_GRAD:
            return cdf + u * 0.3989422804014327 * tl.exp(-0.5 * u * u)  # + u * pdf(u)
        return u * cdf


@triton.jit
def _bias_gelu_fwd_kernel(x_ptr, b_ptr, y_ptr, n_elements, n_cols,
                          HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(b_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _gelu_and_grad(u, TANH, False).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, n_elements, n_cols,
                          HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(b_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dx = dy * _gelu_and_grad(u, TANH, True)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, out: torch.Tensor, *tensors: torch.Tensor, bias: Optional[torch.Tensor], approximate: str):
    n = out.numel()
    if n:
        grid = (triton.cdiv(n, ELEMENTWISE_BLOCK),)
        kernel[grid](*tensors, bias if bias is not None else out, out, n, out.shape[-1],
                     HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=ELEMENTWISE_BLOCK)
    return out


def bias_gelu_forward(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> torch.Tensor:
    x = x.contiguous()
    return _launch(_bias_gelu_fwd_kernel, torch.empty_like(x), x,
                   bias=None if bias is None else bias.contiguous(), approximate=approximate)


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                       approximate: str) -> torch.Tensor:
    x = x.contiguous()
    return _launch(_bias_gelu_bwd_kernel, torch.empty_like(x), dy.contiguous(), x,
                   bias=None if bias is None else bias.contiguous(), approximate=approximate)


@torch.library.custom_op("oslo_models::bias_gelu", mutates_args=())
def _bias_gelu_op(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> torch.Tensor:
    return bias_gelu_forward(x, bias, approximate)


@_bias_gelu_op.register_fake
def _(x, bias, approximate):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("oslo_models::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                           approximate: str) -> torch.Tensor:
    return bias_gelu_backward(dy, x, bias, approximate)


@_bias_gelu_backward_op.register_fake
def _(dy, x, bias, approximate):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _save_for_backward(ctx, inputs, output):
    x, bias, ctx.approximate = inputs
    ctx.save_for_backward(x, bias)


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx = torch.ops.oslo_models.bias_gelu_backward(dy, x, bias, ctx.approximate)
    return dx, bias_grad(dx, None if bias is None else bias.dtype), None


torch.library.register_autograd("oslo_models::bias_gelu", _backward, setup_context=_save_for_backward)


def bias_gelu_reference(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "tanh") -> torch.Tensor:
    """Plain torch: ``F.gelu(x + bias, approximate=...)``."""
    return torch.nn.functional.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor] = None, approximate: str = "tanh", *,
              enabled: bool = True, force_triton: bool = False) -> torch.Tensor:
    """``gelu(x + bias)`` with ``x`` ``[..., hidden]`` and ``bias`` ``[hidden]`` or None."""
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"bias_gelu: approximate must be one of {_APPROXIMATIONS}, got {approximate!r}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias_gelu: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")
    if use_triton(x, bias, enabled=enabled, force_triton=force_triton):
        return torch.ops.oslo_models.bias_gelu(x, bias, approximate)
    return bias_gelu_reference(x, bias, approximate)
