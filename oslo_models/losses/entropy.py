"""Per-token entropy of the next-token distribution from vocab-split logits (GRPO's entropy bonus and metrics).

``H = logsumexp(z) - sum softmax(z) z`` with ``z = logits / temperature`` over the whole vocabulary, on this rank's
``[..., V_padded/tp]`` columns (``token_statistics.py`` holds the autograd Function).

Collectives over the tensor-parallel group: forward one all-reduce MAX and one all-reduce SUM of ``[k, tokens]``
vectors; backward none (``dH / dz = -p (log p + H)``, each rank for its own columns).
"""
from __future__ import annotations

import torch

from .token_statistics import token_statistics
from .vocab_shard import VocabShard


def token_entropy(logits: torch.Tensor, *, shard: VocabShard | None = None, temperature: float = 1.0,
                  chunk_size: int | None = None) -> torch.Tensor:
    """``[...]`` fp32 entropy (nats) of the softmax of ``logits [..., V_padded/tp] / temperature`` over the whole
    vocabulary, for every position (multiply by your mask). Differentiable with respect to ``logits``."""
    targets = torch.full(logits.shape[:-1], -1, dtype=torch.long, device=logits.device)
    return token_statistics(logits, targets, shard=shard, outputs=("entropy",), ignore_index=-1,
                            temperature=temperature, chunk_size=chunk_size)["entropy"]
