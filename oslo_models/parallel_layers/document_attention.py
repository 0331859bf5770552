"""The FlexAttention core for packed documents: a block mask from document ranges, score modifications for the
families' extras, and no ``[s, s]`` tensor anywhere.

A packed batch (``utils/documents.py``: restarting ``position_ids``, ``cu_seqlens`` or ``seq_idx``) gives every
token a document id, ``documents [b, s]``; a token attends to earlier tokens of its own document (and, for a
sliding-window layer, only to the ``w - 1`` before it). The stack hands the attention layers a :class:`DocumentMask`
instead of a dense mask when the core is FlexAttention (``attn_implementation="flex_attention"``, or the default
``"sdpa"`` on a device where Flex trains: :func:`flex_trains`), and ``attention_function`` routes it here.

The block mask is computed from per-block summaries, never from the dense mask: for each (query block, key block)
pair of ``BLOCK`` tokens, the smallest and largest document id of each side say whether the pair can share a
document, the block indices whether it is above the diagonal or out of the window; pairs that are entirely inside
one document, below the diagonal and inside the window are *full* (no ``mask_mod`` call), the others that can
overlap are *partial*. Memory ``O(b * (s / BLOCK)^2)``. ``mask_mod`` reads ``documents`` (padded to the block
multiple with ``-1``, a document no query has).

Score modifications, where the families need them: logit soft-capping ``c * tanh(x / c)`` (Gemma 2), ALiBi
``slope[h] * (k - q)`` (within a document the relative distance is the position distance; BLOOM and Falcon's
key-only bias differs by a per-row constant, which softmax ignores), learned sinks (gpt-oss) by renormalising
with the log-sum-exp: ``out * sigmoid(lse - sink[h])``.

Devices: the kernel is ``torch.compile``d once per process and device type (:func:`_compiled_flex`). torch has
no FlexAttention backward on CPU, and on CPU its compiled kernel returns no log-sum-exp: a call that needs
gradients on CPU is refused with the reason (the default never picks Flex there: SDPA with the dense mask trains),
sinks on CPU run the uncompiled kernel. Attention-probability dropout is refused, as ``transformers`` does for Flex.

Shapes: ``query [b, n, s, d]``, ``key``/``value [b, n_kv, s, d]`` (this rank's heads); returns ``[b, s, n, d]``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

BLOCK = 128  # FlexAttention's default sparse block; a test may build with a smaller one


def flex_available() -> bool:
    """Whether this torch has FlexAttention block masks (torch >= 2.5)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def flex_trains(device: torch.device) -> bool:
    """Whether FlexAttention runs forward and backward on ``device`` (torch: CUDA yes, CPU forward only)."""
    return device.type == "cuda" and flex_available()


@dataclass
class DocumentMask:
    """The mask of one forward for packed documents: ``documents [b, s]`` (int64, equal ids attend to each other,
    earlier to later), ``causal``. Block masks are built on first use, one per sliding window, and kept for the
    other layers of the same forward."""

    documents: torch.Tensor
    causal: bool = True
    block: int = BLOCK
    _built: dict = field(default_factory=dict, repr=False)

    def block_mask(self, window: int | None):
        if window not in self._built:
            self._built[window] = document_block_mask(self.documents, window=window, causal=self.causal,
                                                      block=self.block)
        return self._built[window]


def _block_summaries(documents: torch.Tensor, block: int):
    """``(lowest, highest)`` document id of each block ``[b, nb]`` over real tokens, and the padded ids."""
    batch, seq = documents.shape
    num_blocks = -(-seq // block)
    pad = num_blocks * block - seq
    padded = torch.nn.functional.pad(documents, (0, pad), value=-1)
    big = 1 << 62  # above every id; a power of two survives F.pad's float fill value exactly
    lowest = torch.nn.functional.pad(documents, (0, pad), value=big).view(batch, num_blocks, block).amin(-1)
    highest = padded.view(batch, num_blocks, block).amax(-1)
    return lowest, highest, padded


def _to_indices(blocks: torch.Tensor):
    """``[b, nq, nkv]`` booleans -> (``num [b, 1, nq]`` int32, ``indices [b, 1, nq, nkv]`` int32, listed first)."""
    num = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], order[:, None]


def document_block_mask(documents: torch.Tensor, *, window: int | None = None, causal: bool = True,
                        block: int = BLOCK):
    """The FlexAttention ``BlockMask`` of ``documents [b, s]``: same document, and (``causal``) key <= query, and
    (``window``) query - key < ``window`` (``|query - key| < window`` when not ``causal``); built from block
    summaries (module docstring), no ``[s, s]`` tensor."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, seq = documents.shape
    documents = documents.to(torch.long)
    lowest, highest, padded = _block_summaries(documents, block)
    num_blocks = lowest.shape[1]
    # can some query of block i share a document with some key of block j (ids overlap as ranges)
    overlap = (lowest[:, :, None] <= highest[:, None, :]) & (lowest[:, None, :] <= highest[:, :, None])
    single = (lowest == highest)[:, :, None] & (lowest == highest)[:, None, :] & \
        (lowest[:, :, None] == lowest[:, None, :])
    index = torch.arange(num_blocks, device=documents.device)
    q_first, q_last = index[:, None] * block, index[:, None] * block + block - 1
    k_first, k_last = index[None, :] * block, index[None, :] * block + block - 1
    some = overlap.clone()
    every = single & (index[:, None] != num_blocks - 1) & (index[None, :] != num_blocks - 1) \
        if seq % block else single.clone()
    if causal:
        some &= (k_first <= q_last)
        every &= (k_last <= q_first)
    if window is not None:
        some &= (q_first - k_last < window)
        every &= (q_last - k_first < window)
        if not causal:  # bidirectional: |q - k| < window (ModernBERT's local layers)
            some &= (k_first - q_last < window)
            every &= (k_last - q_first < window)
    partial = some & ~every
    kv_num, kv_index = _to_indices(partial)
    full_num, full_index = _to_indices(every)

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = padded[b, q_idx] == padded[b, kv_idx]
        if causal:
            allowed = allowed & (kv_idx <= q_idx)
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
            if not causal:
                allowed = allowed & (kv_idx - q_idx < window)
        return allowed

    return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(seq, seq))


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, n_kv, s, d = x.shape
    return x[:, :, None].expand(b, n_kv, groups, s, d).reshape(b, n_kv * groups, s, d)


def document_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                       *, dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                       softcap: float | None = None, s_aux: torch.Tensor | None = None,
                       alibi_slopes: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """FlexAttention of ``query [b, n, s, d]`` over ``key, value [b, n_kv, s, d]`` under the ``DocumentMask``
    ``attention_mask``; ``([b, s, n, d], None)`` (the attention interface's return). ``alibi_slopes [n]`` and
    ``s_aux [n]`` are this rank's heads' (module docstring for the score modifications)."""
    from torch.nn.attention.flex_attention import flex_attention

    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("an additive position bias (T5) on the packed-document Flex core is not "
                                  "implemented: use attn_implementation='sdpa' or 'eager'")
    if dropout:
        raise ValueError("FlexAttention has no attention-probability dropout: set attn_implementation='sdpa' (the "
                         "same per-document attention through a dense mask) or turn the attention dropout off")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if query.device.type == "cpu" and grad:
        raise NotImplementedError(
            "FlexAttention has no backward on CPU in this torch: train packed batches on CPU with "
            "attn_implementation='sdpa' or 'eager' (the same per-document attention through a dense mask)")
    # GQA: transformers' finding, compiled Flex needs a power-of-two query head count for enable_gqa (tp splits)
    heads = query.shape[1]
    if heads & (heads - 1):
        key, value = (_repeat_kv(t, heads // t.shape[1]) for t in (key, value))

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            score = score + alibi_slopes[h] * (kv_idx - q_idx)
        return score

    extras = softcap is not None or alibi_slopes is not None
    options = dict(score_mod=score_mod if extras else None, block_mask=attention_mask.block_mask(sliding_window),
                   scale=scaling, enable_gqa=key.shape[1] != heads)
    if s_aux is None:
        out = _compiled_flex(query.device.type)(query, key, value, **options)
    else:  # the compiled CPU kernel returns no log-sum-exp: the uncompiled one there
        from torch.nn.attention.flex_attention import AuxRequest

        run = flex_attention if query.device.type == "cpu" else _compiled_flex(query.device.type)
        out, aux = run(query, key, value, return_aux=AuxRequest(lse=True), **options)
        keep = torch.sigmoid(aux.lse - s_aux.to(aux.lse.dtype)[None, :, None])  # [b, n, s]: 1 - the sink's share
        out = (out * keep[..., None].to(out.dtype)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=None)
def _compiled_flex(device_type: str):
    """One compiled ``flex_attention`` per device type for the process (a memo, like ``transformers``' own: a new
    ``torch.compile`` wrapper per call would compile again). Static shapes on CPU: torch's CPU Flex template fails
    to build once dynamo turns to dynamic shapes (seen with torch 2.13 on the third sequence length); a packed
    batch of a fixed token budget keeps one shape."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)
