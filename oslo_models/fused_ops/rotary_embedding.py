"""Rotary position embedding, Llama/NeoX "half rotation" layout, in place or not; forward and backward in Triton.

For each head vector ``x = [x1, x2]`` (the two halves of ``head_dim``) and per-position ``cos = [c1, c2]``,
``sin = [s1, s2]`` (HF builds them as ``cat(freqs, freqs)``, so ``c1 == c2``, but any values work):

    y1 = x1 * c1 - x2 * s1,    y2 = x2 * c2 + x1 * s2       (= x * cos + rotate_half(x) * sin)

which is exactly ``transformers``' ``apply_rotary_pos_emb``. The backward is the transposed rotation,
``dx1 = dy1 * c1 + dy2 * s2``, ``dx2 = dy2 * c2 - dy1 * s1``, i.e. the same kernel with ``conj=True``.

Layouts (as HF): ``q`` ``[batch, heads_q, seq, head_dim]`` and ``k`` ``[batch, heads_k, seq, head_dim]`` with
``unsqueeze_dim=1`` (or ``[batch, seq, heads, head_dim]`` with ``unsqueeze_dim=2``); ``cos``/``sin``
``[batch, seq, head_dim]`` or ``[seq, head_dim]``. ``head_dim`` must be even; any other size works. One program
handles every head of one (batch, position), so each cos/sin row is read once per tensor. Outputs keep the
input's dtype and memory layout. ``cos``/``sin`` are constants (HF computes them under ``no_grad``); passing
ones that require grad is an error rather than a silently missing gradient.
"""
from __future__ import annotations

import torch

from oslo_models.fused_ops._utils import next_power_of_2, tl, triton
from oslo_models.fused_ops.dispatch import use_triton


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, seq_len, n_heads, half,
                   x_sb, x_sh, x_ss, y_sb, y_sh, y_ss, c_sb, c_ss,
                   CONJ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (d < half)
    c_row = b * c_sb + s * c_ss
    c1 = tl.load(cos_ptr + c_row + d, mask=d < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_row + half + d, mask=d < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + c_row + d, mask=d < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + c_row + half + d, mask=d < half, other=0.0).to(tl.float32)
    x_row = x_ptr + b * x_sb + s * x_ss + heads * x_sh
    x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + d, mask=mask, other=0.0).to(tl.float32)
    if CONJ:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_row = y_ptr + b * y_sb + s * y_ss + heads * y_sh
    tl.store(y_row + d, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + half + d, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, conj: bool) -> None:
    """x/out: ``[batch, heads, seq, head_dim]`` with unit stride on head_dim; cos/sin: ``[batch, seq, head_dim]``."""
    batch, heads, seq, head_dim = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    c_sb = cos.stride(0) if cos.shape[0] > 1 else 0
    if batch * seq == 0 or heads == 0:
        return
    _rotary_kernel[(batch * seq,)](
        x, cos, sin, out, seq, heads, head_dim // 2, x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2), c_sb, cos.stride(1),
        CONJ=conj, BLOCK_H=next_power_of_2(heads), BLOCK_D=next_power_of_2(head_dim // 2))


def _canonical(x: torch.Tensor) -> torch.Tensor:
    # The kernel needs unit stride on head_dim only; every other dim is addressed through strides.
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("oslo_models::rotary_embedding", mutates_args=())
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, conj: bool) -> torch.Tensor:
    x = _canonical(x)
    out = torch.empty_like(x)
    _launch(x, cos, sin, out, conj)
    return out


@_rotary_op.register_fake
def _(x, cos, sin, conj):
    return torch.empty_like(x)


@torch.library.custom_op("oslo_models::rotary_embedding_", mutates_args=("x",))
def _rotary_inplace_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, conj: bool) -> None:
    if x.stride(-1) != 1:
        raise ValueError("rotary_embedding(inplace=True) needs unit stride on head_dim")
    _launch(x, cos, sin, x, conj)


@_rotary_inplace_op.register_fake
def _(x, cos, sin, conj):
    return None


def _save_for_backward(ctx, inputs, output):
    x, cos, sin, ctx.conj = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dy):
    """The conjugate rotation."""
    return torch.ops.oslo_models.rotary_embedding(dy, *ctx.saved_tensors, not ctx.conj), None, None, None


torch.library.register_autograd("oslo_models::rotary_embedding", _backward, setup_context=_save_for_backward)


class RotaryInplaceFunction(torch.autograd.Function):
    """In-place variant: rotates ``x``'s storage (``mark_dirty``); backward is the out-of-place conj rotation."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        torch.ops.oslo_models.rotary_embedding_(x, cos, sin, False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return torch.ops.oslo_models.rotary_embedding(dy, cos, sin, True), None, None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_embedding_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, the formula of ``transformers``' ``apply_rotary_pos_emb`` (which also takes 2-D cos/sin)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> None:
    if x.dim() != 4 or unsqueeze_dim not in (1, 2):
        raise ValueError(f"rotary_embedding: expected 4-D q/k and unsqueeze_dim 1 or 2, got shape "
                         f"{tuple(x.shape)} and unsqueeze_dim={unsqueeze_dim}")
    head_dim = x.shape[-1]
    seq = x.shape[2] if unsqueeze_dim == 1 else x.shape[1]
    if head_dim % 2:
        raise ValueError(f"rotary_embedding: head_dim must be even, got {head_dim}")
    if cos.shape != sin.shape or cos.shape[-2:] != (seq, head_dim) or cos.dim() not in (2, 3) or (
            cos.dim() == 3 and cos.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"rotary_embedding: cos/sin must be [batch, seq, head_dim] or [seq, head_dim] with "
                         f"seq={seq}, head_dim={head_dim}; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rotary_embedding: cos/sin are treated as constants; detach them (HF computes them "
                         "under no_grad)")


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int, inplace: bool):
    x4 = x.transpose(1, 2) if unsqueeze_dim == 2 else x  # -> [batch, heads, seq, head_dim] view
    if inplace:
        RotaryInplaceFunction.apply(x4, cos, sin)
        return x
    y = torch.ops.oslo_models.rotary_embedding(x4, cos, sin, False)
    return y.transpose(1, 2) if unsqueeze_dim == 2 else y


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                     unsqueeze_dim: int = 1, inplace: bool = False, enabled: bool = True,
                     force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_embed, k_embed)`` as ``apply_rotary_pos_emb``; ``inplace=True`` overwrites and returns q and k."""
    for x in (q, k):
        _check(x, cos, sin, unsqueeze_dim)
    if not use_triton(q, k, cos, sin, enabled=enabled, force_triton=force_triton):
        q_embed, k_embed = rotary_embedding_reference(q, k, cos, sin, unsqueeze_dim)
        if inplace:
            return q.copy_(q_embed), k.copy_(k_embed)
        return q_embed, k_embed
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return _apply(q, cos, sin, unsqueeze_dim, inplace), _apply(k, cos, sin, unsqueeze_dim, inplace)
