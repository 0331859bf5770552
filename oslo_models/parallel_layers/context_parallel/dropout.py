"""Attention-probability dropout under context parallelism: a mask that is a function of *global* coordinates.

``transformers``' eager attention draws one Bernoulli mask ``[b, n, s, s]`` from torch's generator; a cp rank
holds a chunk of the queries (ring) or of the heads (all-to-all) and never the whole ``s x s`` matrix, so it cannot
draw "its slice" of that stream without drawing all of it. Here the keep bit of the probability of query position
``i`` for key position ``j`` in row ``b`` and head ``h`` is instead a counter-based hash (Wellons' ``lowbias32``,
four rounds chained over ``seed, b, h, i, j``) compared with ``p``: the same bit whichever rank computes it, in
any tile order, in the forward and in the recomputing backward. So the mask follows the chunk: the ring and the
all-to-all cores and a dense computation over the whole sequence (``keep_mask`` on the full index) draw the same
mask, and the kept probabilities are scaled by ``1 / (1 - p)`` as ``F.dropout`` does.

``seed``: one int per attention call, drawn from torch's generator of the query's device inside the layer's
dropout RNG context (the tensor-parallel stream under TP, so tensor-parallel ranks, whose ``h`` are local head
numbers, draw independent masks; ``cp`` ranks share a stream when seeded alike, as every rank of a job is). An
activation-checkpointing recompute restores that generator, so it draws the same seed. ``b`` is the local row and
``h`` the head number on this tensor-parallel rank.

Limit: the masks are not bit-equal to ``transformers``' eager dropout (nor to this library's cp=1 path, which is
``transformers``' own); they are statistically the same (independent keep bits with probability ``1 - p``,
quantized to ``2**-24``). Everything here is local (no collective).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_BITS = 24  # keep bits compare the hash's top 24 bits with p * 2**24


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` with no int64 overflow (16-bit halves)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + (((high * (constant & 0xFFFF)) & 0xFFFF) << 16)) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32``: a bijective avalanche hash of 32-bit values held in int64."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout probability ``p`` and the ``seed`` of one attention call (see the module docstring)."""

    p: float
    seed: int

    @classmethod
    def draw(cls, p: float, device) -> "AttentionDropout | None":
        """``None`` for ``p == 0``; else a seed drawn from torch's generator of ``device``."""
        if not p:
            return None
        if not 0.0 < p < 1.0:
            raise ValueError(f"attention dropout probability must be in [0, 1), got {p}")
        return cls(float(p), int(torch.randint(0, 2 ** 31 - 1, (1,), device=device).item()))

    def keep_scale(self, batch: int, heads: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
                   dtype=torch.float32) -> torch.Tensor:
        """``[batch, len(heads), len(q_index), len(k_index)]``: ``1 / (1 - p)`` where the probability is kept, else
        0. ``heads``, ``q_index``, ``k_index``: int64 head numbers and global token positions."""
        keep = keep_mask(self.seed, self.p, batch, heads, q_index, k_index)
        return keep.to(dtype) / (1.0 - self.p)


def keep_mask(seed: int, p: float, batch: int, heads: torch.Tensor, q_index: torch.Tensor,
              k_index: torch.Tensor) -> torch.Tensor:
    """Bool ``[batch, n, s_q, s_k]``: whether the probability of ``(b, heads[h], q_index[i], k_index[j])`` is kept."""
    device = q_index.device
    rows = torch.arange(batch, device=device, dtype=torch.int64)[:, None, None, None]
    x = _mix(rows + (seed & _MASK32))
    x = _mix(x ^ heads.to(device, torch.int64)[None, :, None, None])
    x = _mix(x ^ q_index.to(torch.int64)[None, None, :, None])
    x = _mix(x ^ k_index.to(device, torch.int64)[None, None, None, :])
    return (x >> (32 - _BITS)) >= round(p * 2 ** _BITS)
