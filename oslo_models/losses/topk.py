"""The k largest logits of each position and their vocabulary ids, from vocab-split logits.

Each rank takes the top ``min(k, V_local)`` of its own columns (padded ones are ``-inf`` and lose to every real
id), the candidates of the group are all-gathered (``[tp, tokens, k]`` values and ids) and the top ``k`` of those
are the global top ``k``. What a teacher hands to :func:`~oslo_models.losses.topk_kl_divergence` (a teacher at
another layout, or one precomputed offline), and what sampling and logging read.

Collectives over the tensor-parallel group: forward two all-gathers (values, ids) of ``[tokens, k]``. No
gradient: the values are returned detached.
"""
from __future__ import annotations

import torch

from .vocab_shard import VocabShard, as_rows


@torch.no_grad()
def topk_logits(logits: torch.Tensor, k: int, *, shard: VocabShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [..., k], indices [..., k])``: the ``k`` largest of the whole vocabulary's logits per position,
    sorted descending, values in the logits' dtype and indices as global vocabulary ids (int64), for ``logits
    [..., V_padded/tp]`` (this rank's columns). Every rank of the group returns the same."""
    shard = shard or VocabShard()
    rows = as_rows(logits)
    num_local = rows.shape[-1]
    vocab = shard.vocab_size if shard.vocab_size is not None else num_local * shard.size
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be between 1 and the vocabulary size {vocab}, got {k}")
    values, ids = rows.topk(min(k, num_local), dim=-1)
    ids = ids + shard.vocab_start
    if shard.size > 1:
        all_values = shard.all_gather(values)  # [tp, tokens, k_local]
        all_ids = shard.all_gather(ids)
        values = all_values.permute(1, 0, 2).reshape(rows.shape[0], -1)
        ids = all_ids.permute(1, 0, 2).reshape(rows.shape[0], -1)
        values, order = values.topk(k, dim=-1)
        ids = ids.gather(-1, order)
    shape = (*logits.shape[:-1], k)
    return values.reshape(shape), ids.reshape(shape)
