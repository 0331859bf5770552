"""FlexAttention blocks for the context-parallel cores: one ``flex_attention`` call per (query chunk(s), key/value
block) pair of a ring step (or of the all-to-all's gathered sequence), with a ``BlockMask`` built from that pair's
documents, causality, sliding window and padding, and a ``score_mod`` for soft-capping and ALiBi; the call returns
the log-sum-exp, which the ring merges across its steps exactly as the tile path's (``ring._merge``).

The block mask is built from per-block summaries (``BLOCK`` query rows x ``BLOCK`` keys): the smallest and largest
global position, document id and (keys) padding of each block say whether the pair can have a visible entry
(*partial*: ``mask_mod`` decides per entry) or is visible entirely (*full*: no ``mask_mod`` call), the same rule as
``parallel_layers/document_attention.py`` but over global positions, so it holds for the ring's mirrored chunks and
for any block of any rank. Memory ``O(b * (s_q / BLOCK) * (s_k / BLOCK))``: no ``[s, s]`` mask. ``mask_mod`` reads
``[s]`` positions and ``[b, s]`` documents / padding (padded to the block multiple by repeating the last entry, a
padded key marked invalid).

Devices (the choice is ``ring.choose_impl``): on CUDA the kernel is ``torch.compile``d (the per-process memo of
``document_attention._compiled_flex``) and returns the log-sum-exp; the backward recomputes each block through the
same compiled kernel under autograd (:func:`block_vjp`). On CPU torch's compiled Flex returns no log-sum-exp and
Flex has no backward at all, so the forward runs the uncompiled kernel (torch's math reference: it materialises
the scores of the call, which is why the CPU path calls it per tile of query rows, like the fp32 tile path) and the
backward is the ring's fp32 tile recompute from the saved log-sum-exp (exact: the same softmax). That makes Flex on
CPU selectable (``attn_implementation="flex_attention"``) but not faster: see BENCHMARKS.md.

``return_lse`` / ``return_aux``: torch 2.9+ take ``return_aux=AuxRequest(lse=True)`` (``return_lse`` deprecated);
older ones only ``return_lse=True``: :func:`flex_with_lse` handles both.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

BLOCK = 128  # FlexAttention's default sparse block


def flex_with_lse(query, key, value, *, block_mask, score_mod, scale: float, compiled: bool):
    """``(out [b, n, s_q, d_v], lse [b, n, s_q])`` of ``flex_attention`` (fp32 natural-log log-sum-exp; ``-inf``
    and zeros for a row that sees no key), whichever of ``return_aux`` / ``return_lse`` this torch has."""
    from torch.nn.attention import flex_attention as flex_module

    if compiled:
        from ..document_attention import _compiled_flex

        run = _compiled_flex(query.device.type)
    else:
        run = flex_module.flex_attention
    options = dict(block_mask=block_mask, score_mod=score_mod, scale=scale)
    with warnings.catch_warnings():  # the uncompiled kernel warns that it materialises the scores: we tile rows
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if hasattr(flex_module, "AuxRequest"):
            out, aux = run(query, key, value, return_aux=flex_module.AuxRequest(lse=True), **options)
            return out, aux.lse
        return run(query, key, value, return_lse=True, **options)


def _pad_last(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t [..., s]`` with its last entry repeated ``pad`` times (a block summary's neutral padding)."""
    return t if not pad else torch.cat([t, t[..., -1:].expand(*t.shape[:-1], pad)], dim=-1)


def _summaries(t: torch.Tensor, block: int):
    """``(min, max)`` of ``t [..., s]`` over blocks of ``block`` (the last one padded by repetition)."""
    pad = -t.shape[-1] % block
    blocks = _pad_last(t, pad).unflatten(-1, (-1, block))
    return blocks.amin(-1), blocks.amax(-1)


def _to_indices(blocks: torch.Tensor):
    """``[b, nq, nk]`` booleans -> (``num [b, 1, nq]`` int32, ``indices [b, 1, nq, nk]`` int32, listed first)."""
    num = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], order[:, None]


def pair_block_mask(q_index: torch.Tensor, k_index: torch.Tensor, *, causal: bool, window: int | None = None,
                    q_document: torch.Tensor | None = None, k_document: torch.Tensor | None = None,
                    k_valid: torch.Tensor | None = None, block: int = BLOCK):
    """The ``BlockMask`` of queries at global positions ``q_index [s_q]`` over keys at ``k_index [s_k]``:
    (``causal``) key <= query, (``window``) query - key < window (``|query - key| < window`` when not causal),
    (``k_valid [b, s_k]``) the key is no padding, (``q_document [b, s_q]``, ``k_document [b, s_k]``) the same
    document; ``ContextParallelMask.allowed``'s rule. ``None`` when every key is visible to every query."""
    from torch.nn.attention.flex_attention import BlockMask

    if not causal and window is None and k_valid is None and k_document is None:
        return None
    s_q, s_k = q_index.shape[0], k_index.shape[0]
    batch = next((t.shape[0] for t in (q_document, k_valid) if t is not None), 1)
    q_lo, q_hi = _summaries(q_index, block)  # [nq]
    k_lo, k_hi = _summaries(k_index, block)  # [nk]
    q_lo, q_hi, k_lo, k_hi = q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :]
    some = torch.ones(batch, q_lo.shape[0], k_lo.shape[1], dtype=torch.bool, device=q_index.device)
    every = some.clone()
    if causal:
        some = some & (k_lo <= q_hi)
        every = every & (k_hi <= q_lo)
        if window is not None:
            some = some & (q_lo - k_hi < window)
            every = every & (q_hi - k_lo < window)
    elif window is not None:  # bidirectional: |q - k| < window (ModernBERT's local layers)
        some = some & (q_lo - k_hi < window) & (k_lo - q_hi < window)
        every = every & (q_hi - k_lo < window) & (k_hi - q_lo < window)
    if k_valid is not None:
        lo, hi = _summaries(k_valid.to(torch.int8), block)  # [b, nk]
        some, every = some & (hi > 0)[:, None, :], every & (lo > 0)[:, None, :]
    if k_document is not None:
        qd_lo, qd_hi = _summaries(q_document, block)
        kd_lo, kd_hi = _summaries(k_document, block)
        some = some & (qd_lo[:, :, None] <= kd_hi[:, None, :]) & (kd_lo[:, None, :] <= qd_hi[:, :, None])
        every = every & (qd_lo == qd_hi)[:, :, None] & (kd_lo == kd_hi)[:, None, :] & \
            (qd_lo[:, :, None] == kd_lo[:, None, :])
    if s_q % block:  # a partial block is never listed as full: the kernels read whole blocks
        every[:, -1, :] = False
    if s_k % block:
        every[:, :, -1] = False
    kv_num, kv_index = _to_indices(some & ~every)
    full_num, full_index = _to_indices(every)
    q_pos, k_pos = _pad_last(q_index, -s_q % block), _pad_last(k_index, -s_k % block)
    q_doc = None if q_document is None else _pad_last(q_document, -s_q % block)
    k_doc = None if k_document is None else _pad_last(k_document, -s_k % block)
    valid = None if k_valid is None else F.pad(k_valid, (0, -s_k % block), value=False)

    def mask_mod(b, h, q_idx, kv_idx):
        qp, kp = q_pos[q_idx], k_pos[kv_idx]
        allowed = kv_idx >= 0
        if causal:
            allowed = allowed & (kp <= qp)
            if window is not None:
                allowed = allowed & (kp > qp - window)
        elif window is not None:
            allowed = allowed & (kp - qp < window) & (qp - kp < window)
        if valid is not None:
            allowed = allowed & valid[b, kv_idx]
        if k_doc is not None:
            allowed = allowed & (q_doc[b, q_idx] == k_doc[b, kv_idx])
        return allowed

    return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(s_q, s_k))


def score_mod_for(softcap: float | None, alibi: torch.Tensor | None):
    """The ``score_mod`` of a block: ``c * tanh(score / c)`` (Gemma 2), then ``+ alibi[b, h, key]`` (``alibi [b, n,
    s_k]``: each key's ALiBi bias, ``mask.AlibiBias.key_bias``); ``None`` when neither."""
    if softcap is None and alibi is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if alibi is not None:
            score = score + alibi[b, h, kv_idx]
        return score

    return score_mod


def block_vjp(run, q, k, v, dout, out, lse, delta):
    """The gradients ``(dq, dk, dv)`` one block contributes, by autograd through ``run(q, k, v) -> (out_b,
    lse_b)`` recomputed (Flex's own backward on CUDA). The final output is ``O = sum_b exp(lse_b - lse) out_b``
    (``lse``: the merged, sink-including log-sum-exp ``[b, n, s]``), so ``dL/dout_b = w_b dO`` and ``dL/dlse_b =
    w_b (rowsum(dO * out_b) - delta)`` with ``w_b = exp(lse_b - lse)``, ``delta = rowsum(dO * O)`` ``[b, n, s]``."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        block_out, block_lse = run(*leaves)
        live = torch.isfinite(block_lse) & torch.isfinite(lse)
        weight = torch.where(live, torch.exp(block_lse.detach() - lse.masked_fill(~live, 0.0)), 0.0)
        grad_out = weight[..., None] * dout
        grad_lse = weight * ((dout * block_out.detach()).sum(-1) - delta)
        grads = torch.autograd.grad((block_out, block_lse), leaves, (grad_out, grad_lse), allow_unused=True)
    return tuple(torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves))
