"""Falcon's config: ``transformers.FalconConfig`` itself (same ``model_type``, same ``config.json``). No
``base_model_tp_plan`` is published: ``transformers``' plan vocabulary has no style for the fused ``query_key_value``
of grouped ``[q.., k, v]`` heads (a plain column split would separate queries from their keys)."""
from transformers import FalconConfig

__all__ = ["FalconConfig"]
