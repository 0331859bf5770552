"""Bloom's config: ``transformers.BloomConfig`` itself (same ``model_type``, same ``config.json``). No
``base_model_tp_plan`` is published: ``transformers``' plan vocabulary has no style for the fused ``query_key_value``
of per-head ``[q, k, v]`` blocks (a plain column split would separate queries from their keys)."""
from transformers import BloomConfig

__all__ = ["BloomConfig"]
