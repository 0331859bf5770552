"""Scaled, masked softmax over attention scores: forward and backward in Triton.

``probs = softmax(scale * scores)`` over the last dim, where masked positions get probability exactly 0.

Layout: ``scores`` is ``[batch, heads, q_len, k_len]`` (fp32/fp16/bf16, any ``k_len`` up to 65536); ``probs``
has the same shape and dtype.

Masking (both optional, combined with AND):

- ``causal=True``: query ``i`` sees keys ``j <= i + (k_len - q_len)``. The diagonal is aligned bottom-right, so
  with a KV cache (``q_len < k_len``) the new queries see the whole past, as HF and flash-attention do.
- ``mask``: True/nonzero = attend (the HF ``attention_mask`` convention), either ``[batch, k_len]`` padding or
  any bool/int tensor broadcastable to ``[batch, heads, q_len, k_len]`` (e.g. ``[batch, 1, q_len, k_len]``).
  It is read through broadcast strides, never materialized.

A row with every key masked (e.g. a left-padding query under a causal mask) returns all zeros and a zero
gradient, where a plain ``-inf`` softmax would return NaN.

Backward: ``dscores = scale * probs * (dprobs - sum(dprobs * probs))``, computed from the saved ``probs``.
"""
from __future__ import annotations

from typing import Optional

import torch

from oslo_models.fused_ops._utils import as_rows, row_block_settings, tl, triton
from oslo_models.fused_ops.dispatch import use_triton


@triton.jit
def _softmax_fwd_kernel(x_ptr, mask_ptr, y_ptr, n_heads, q_len, k_len, scale,
                        m_sb, m_sh, m_sq, m_sk,
                        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    q = row % q_len
    h = (row // q_len) % n_heads
    b = row // (q_len * n_heads)
    cols = tl.arange(0, BLOCK)
    keep = cols < k_len
    x = tl.load(x_ptr + row * k_len + cols, mask=keep, other=0.0).to(tl.float32) * scale
    if CAUSAL:
        keep = keep & (cols <= q + (k_len - q_len))
    if HAS_MASK:
        m = tl.load(mask_ptr + b * m_sb + h * m_sh + q * m_sq + cols * m_sk, mask=cols < k_len, other=0)
        keep = keep & (m != 0)
    x = tl.where(keep, x, float("-inf"))
    row_max = tl.max(x, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # fully masked row: avoid -inf - -inf
    e = tl.where(keep, tl.exp(x - row_max), 0.0)
    denom = tl.sum(e, axis=0)
    y = e / tl.where(denom == 0.0, 1.0, denom)
    tl.store(y_ptr + row * k_len + cols, y.to(y_ptr.dtype.element_ty), mask=cols < k_len)


@triton.jit
def _softmax_bwd_kernel(dy_ptr, y_ptr, dx_ptr, k_len, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < k_len
    y = tl.load(y_ptr + row * k_len + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * k_len + cols, mask=mask, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=0))
    tl.store(dx_ptr + row * k_len + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _expand_mask(mask: Optional[torch.Tensor], shape: torch.Size) -> Optional[torch.Tensor]:
    """``[batch, k_len]`` or anything broadcastable -> a bool ``[b, h, q, k]`` *view* (stride 0 where broadcast)."""
    if mask is None:
        return None
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
    if mask.dtype != torch.bool:
        mask = mask != 0
    try:
        return mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"softmax: mask of shape {tuple(mask.shape)} does not broadcast to scores "
                         f"{tuple(shape)}") from None


def softmax_forward(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool) -> torch.Tensor:
    """Launch the forward kernel: one program per (batch, head, query) row."""
    batch, heads, q_len, k_len = scores.shape
    x2 = as_rows(scores)
    y = torch.empty_like(x2)
    block, num_warps = row_block_settings(k_len, "softmax")
    mask4 = _expand_mask(mask, scores.shape)
    # bool and uint8 share a layout; the kernel compares against 0 either way.
    mask_arg = mask4.view(torch.uint8) if mask4 is not None else x2
    strides = mask4.stride() if mask4 is not None else (0, 0, 0, 0)
    if x2.shape[0] > 0:
        _softmax_fwd_kernel[(x2.shape[0],)](x2, mask_arg, y, heads, q_len, k_len, scale, *strides,
                                            CAUSAL=causal, HAS_MASK=mask4 is not None, BLOCK=block,
                                            num_warps=num_warps)
    return y.view(scores.shape)


def softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    y2, dy2 = as_rows(y), as_rows(dy)
    dx = torch.empty_like(y2)
    block, num_warps = row_block_settings(y2.shape[1], "softmax")
    if y2.shape[0] > 0:
        _softmax_bwd_kernel[(y2.shape[0],)](dy2, y2, dx, y2.shape[1], scale, BLOCK=block, num_warps=num_warps)
    return dx.view(y.shape)


@torch.library.custom_op("oslo_models::masked_softmax", mutates_args=())
def _softmax_op(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool) -> torch.Tensor:
    return softmax_forward(scores, mask, scale, causal)


@_softmax_op.register_fake
def _(scores, mask, scale, causal):
    return torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)


@torch.library.custom_op("oslo_models::masked_softmax_backward", mutates_args=())
def _softmax_backward_op(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return softmax_backward(dy, y, scale)


@_softmax_backward_op.register_fake
def _(dy, y, scale):
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


def _save_for_backward(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[2]


def _backward(ctx, dy):
    return torch.ops.oslo_models.masked_softmax_backward(dy, *ctx.saved_tensors, ctx.scale), None, None, None


torch.library.register_autograd("oslo_models::masked_softmax", _backward, setup_context=_save_for_backward)


def softmax_reference(scores: torch.Tensor, scale: float = 1.0, causal: bool = False,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch, same function: scale, fill masked with the dtype's min, softmax, zero fully masked rows."""
    q_len, k_len = scores.shape[-2:]
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device)
    if causal:
        keep = torch.ones_like(keep).tril(k_len - q_len)
    if mask is not None:
        keep = keep & _expand_mask(mask, scores.shape)
    s = (scores * scale).masked_fill(~keep, torch.finfo(scores.dtype).min)
    return torch.softmax(s, dim=-1).masked_fill(~keep, 0.0)


def softmax(scores: torch.Tensor, *, scale: float = 1.0, causal: bool = False, mask: Optional[torch.Tensor] = None,
            enabled: bool = True, force_triton: bool = False) -> torch.Tensor:
    """Masked softmax of ``scores`` ``[batch, heads, q_len, k_len]``; see the module docstring."""
    if scores.dim() != 4:
        raise ValueError(f"softmax: scores must be [batch, heads, q_len, k_len], got shape {tuple(scores.shape)}")
    if mask is not None:
        mask = _expand_mask(mask, scores.shape)
    if use_triton(scores, mask, enabled=enabled, force_triton=force_triton):
        return torch.ops.oslo_models.masked_softmax(scores, mask, float(scale), bool(causal))
    return softmax_reference(scores, scale, causal, mask)
