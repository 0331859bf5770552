"""BERT config: ``transformers.BertConfig`` itself (same ``model_type`` and ``config.json``) plus the published
HF-style ``base_model_tp_plan`` (a class attribute, never serialized)."""
from __future__ import annotations

import transformers

from .parallel_plan import published_tp_plan


class BertConfig(transformers.BertConfig):
    base_model_tp_plan = published_tp_plan()
