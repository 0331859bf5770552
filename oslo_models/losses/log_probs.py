"""Per-token log-probabilities of given tokens from vocab-split logits (DPO, GRPO, RLOO, KTO all start here).

``log p(t) = z[t] - logsumexp(z)`` with ``z = logits / temperature`` over the whole vocabulary, computed on this
rank's ``[..., V_padded/tp]`` columns (``token_statistics.py`` holds the autograd Function).

Collectives over the tensor-parallel group: forward one all-reduce MAX and one all-reduce SUM of ``[k, tokens]``
vectors; backward none (``d log p(t) / dz = onehot(t) - softmax(z)``, each rank for its own columns).
"""
from __future__ import annotations

import torch

from .token_statistics import token_statistics
from .vocab_shard import VocabShard


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, shard: VocabShard | None = None,
                    ignore_index: int = -100, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """``[...]`` fp32 log-probabilities of ``targets [...]`` (global vocabulary ids) under the softmax of
    ``logits [..., V_padded/tp] / temperature``; ``0`` (and no gradient) where ``targets == ignore_index``.

    ``logits`` are aligned with ``targets`` (position ``i`` scores ``targets[..., i]``): for a causal LM pass
    ``logits[:, :-1]`` with ``input_ids[:, 1:]``. ``shard``: the vocabulary split (``VocabShard.of(model)``;
    ``None``: the whole vocabulary in one process). Differentiable with respect to ``logits``."""
    return token_statistics(logits, targets, shard=shard, outputs=("log_probs",), ignore_index=ignore_index,
                            temperature=temperature, chunk_size=chunk_size)["log_probs"]
