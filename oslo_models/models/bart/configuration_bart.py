"""BART config: ``transformers``' own ``BartConfig`` (``scale_embedding``, ``tie_word_embeddings``, the encoder /
decoder sizes), re-exported."""
from __future__ import annotations

from transformers import BartConfig

__all__ = ["BartConfig"]
