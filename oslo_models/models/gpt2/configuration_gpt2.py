"""GPT-2 config: ``transformers.GPT2Config`` itself (same ``model_type``, same ``config.json``), plus the
published HF-style ``base_model_tp_plan`` (a class attribute, which ``transformers`` never serializes)."""
from __future__ import annotations

import transformers

from .parallel_plan import GPT2_BASE_PLAN


class GPT2Config(transformers.GPT2Config):
    base_model_tp_plan = GPT2_BASE_PLAN.hf_tp_plan()
