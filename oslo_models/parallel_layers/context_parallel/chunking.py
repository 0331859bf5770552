"""Which tokens of a sequence each context-parallel rank holds, and how to cut (and reassemble) a batch.

Two layouts, one per ``ParallelConfig.context_parallel_mode``:

- ``"ring"``: the sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and
  ``2cp - 1 - r`` (concatenated in that order). Under a causal mask the work of a rank then does not depend on
  ``r`` (an early chunk attends to little, its mirror to a lot): the load balancing of Megatron-Core and torch's
  ``context_parallel``. Needs the sequence length divisible by ``2 * cp``.
- ``"all_to_all"``: rank ``r`` holds the contiguous chunk ``r`` of ``cp``; the all-to-all gathers the whole
  sequence for ``heads/cp`` heads, so balancing is not needed. Needs the length divisible by ``cp``.
- ``"hybrid"``: the ring's layout (the all-to-all inside a group gathers its members' mirrored chunks, the ring
  across the groups is balanced as the plain ring is).

Everything here is local (no collective).
"""
from __future__ import annotations

import torch

RING, ALL_TO_ALL, HYBRID = "ring", "all_to_all", "hybrid"
MIRRORED = (RING, HYBRID)  # the layouts of two mirrored chunks per rank


def num_chunks(cp_size: int, mode: str) -> int:
    """Equal chunks the sequence is cut into: ``2 * cp`` for the ring (and hybrid), ``cp`` for all-to-all."""
    if mode not in (RING, ALL_TO_ALL, HYBRID):
        raise ValueError(f"context_parallel_mode={mode!r} is unknown; choose 'ring', 'all_to_all' or 'hybrid'")
    return 2 * cp_size if mode in MIRRORED and cp_size > 1 else cp_size


def check_sequence_length(seq_len: int, cp_size: int, mode: str) -> None:
    """``ValueError`` unless ``seq_len`` (the full sequence) splits into the layout's equal chunks."""
    chunks = num_chunks(cp_size, mode)
    if seq_len % chunks:
        why = " (two mirrored chunks per rank for causal load balancing)" if mode in MIRRORED else ""
        raise ValueError(f"context parallelism ({mode}, context_parallel_size={cp_size}) needs the sequence length "
                         f"divisible by {chunks}{why}, got {seq_len}; pad to a multiple (pad_to_multiple_of="
                         f"{chunks})")


def chunk_ids(cp_rank: int, cp_size: int, mode: str) -> tuple[int, ...]:
    """The chunk numbers rank ``cp_rank`` holds, in its local order."""
    if num_chunks(cp_size, mode) == cp_size:
        return (cp_rank,)
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def token_index(seq_local: int, cp_rank: int, cp_size: int, mode: str, device=None) -> torch.Tensor:
    """Global positions ``[seq_local]`` (int64) of the tokens rank ``cp_rank`` holds when each rank holds
    ``seq_local`` of them."""
    ids = chunk_ids(cp_rank, cp_size, mode)
    if seq_local % len(ids):
        raise ValueError(f"context parallelism ({mode}) holds {len(ids)} chunks per rank: the local sequence length "
                         f"{seq_local} must be divisible by {len(ids)}")
    size = seq_local // len(ids)
    return torch.cat([torch.arange(i * size, (i + 1) * size, device=device) for i in ids])


def split_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, mode: str, dim: int = 1) -> torch.Tensor:
    """Rank ``cp_rank``'s chunk(s) of ``x`` along ``dim`` (HF ``[batch, seq, ...]``: ``dim=1``)."""
    check_sequence_length(x.shape[dim], cp_size, mode)
    pieces = x.chunk(num_chunks(cp_size, mode), dim=dim)
    return torch.cat([pieces[i] for i in chunk_ids(cp_rank, cp_size, mode)], dim=dim)


def merge_sequence(parts: list[torch.Tensor], mode: str, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`split_sequence`: the full tensor from every rank's part (in cp-rank order)."""
    cp_size = len(parts)
    per_rank = len(chunk_ids(0, cp_size, mode))
    chunks: list[torch.Tensor | None] = [None] * num_chunks(cp_size, mode)
    for rank, part in enumerate(parts):
        for piece, i in zip(part.chunk(per_rank, dim=dim), chunk_ids(rank, cp_size, mode)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)
