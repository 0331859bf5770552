"""Hybrid context parallelism (``context_parallel_mode="hybrid"``): all-to-all inside groups of
``context_parallel_all_to_all_size`` consecutive cp ranks (a node's fast links), ring across the groups.

Each rank holds the ring layout's two mirrored chunks. One all-to-all per tensor inside the group turns
``q, k, v [b, n, s_local, d]`` into ``[b, n/a, a*s_local, d]`` (``a`` the group size: this rank's ``n/a`` heads over
the group's tokens, its members' chunks in member order); the ring (``ring.py``) then runs over the ``cp/a`` groups
with each group's tokens as one key/value block (``ContextParallelMask.ring_view``: positions, padding, documents
and ALiBi regrouped, this rank's heads' slopes); one all-to-all brings the output back. Sinks: this rank's heads'.

Communication per layer and rank: the all-to-all's ``4 * (a-1)/a * b*s_local*n*d`` elements inside the group plus
the ring's ``(cp/a - 1) * 2*b*(n_kv or n/a)*a*s_local*d`` across groups. Needs the heads per tensor-parallel rank
divisible by ``a``. Attention-probability dropout is refused (its keep bits number the heads of the whole
tensor-parallel rank; the ring here sees a slice of them).
"""
from __future__ import annotations

import torch

from .all_to_all import heads_to_sequence, sequence_to_heads
from .dropout import AttentionDropout
from .mask import ContextParallelMask
from .ring import TILES, _expand, ring_attention


def hybrid_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: ContextParallelMask, *,
                     scaling: float, window: int | None = None, dropout: AttentionDropout | None = None,
                     softcap: float | None = None, uniform_dead_rows: bool = False,
                     sinks: torch.Tensor | None = None, impl: str = TILES) -> torch.Tensor:
    """Attention of ``query [b, n, s_local, d]`` over ``key [b, n_kv, s_local, d]``, ``value [b, n_kv, s_local,
    d_v]`` of the whole cp group; returns ``[b, n, s_local, d_v]``. Collectives: forward 4 all-to-alls inside the
    group and the ring's ``cp/a - 1`` hops across; backward the same plus the ring's gradient hops. ``impl``: the
    ring's per-block kernel (``ring.py``)."""
    if dropout is not None:
        raise NotImplementedError("attention dropout under context_parallel_mode='hybrid' is not implemented; use "
                                  "'ring' or 'all_to_all', or turn the attention dropout off")
    groups, heads = mask.hybrid, query.shape[1]
    if heads % groups.inner_size:
        raise ValueError(f"context_parallel_mode='hybrid' needs the attention heads on each tensor-parallel rank "
                         f"({heads}) divisible by context_parallel_all_to_all_size={groups.inner_size}")
    if key.shape[1] % groups.inner_size:  # too few key/value heads to split: every query head gets its own copy
        key, value = (_expand(t, heads // key.shape[1]) for t in (key, value))
    q, k, v = (sequence_to_heads(t, groups.inner_group) for t in (query, key, value))
    inner_rank = mask.rank % groups.inner_size
    mine = slice(inner_rank * q.shape[1], (inner_rank + 1) * q.shape[1])
    out = ring_attention(q, k, v, mask.ring_view(mine), scaling=scaling, window=window, softcap=softcap,
                         uniform_dead_rows=uniform_dead_rows, sinks=None if sinks is None else sinks[mine], impl=impl)
    return heads_to_sequence(out, groups.inner_group)
