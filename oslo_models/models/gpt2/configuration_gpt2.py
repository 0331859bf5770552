"""GPT-2 config: ``transformers.GPT2Config`` itself (same ``model_type``, same ``config.json``), plus the
published HF-style ``base_model_tp_plan`` (a class attribute, which ``transformers`` never serializes)."""
from __future__ import annotations

import transformers

from .parallel_plan import published_tp_plan


class GPT2Config(transformers.GPT2Config):
    base_model_tp_plan = published_tp_plan()
