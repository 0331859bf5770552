"""GPT-J config: ``transformers.GPTJConfig`` itself (same ``model_type``, same ``config.json``), plus the published
``base_model_tp_plan`` read from ``GPTJ_SPEC`` (a class attribute, never serialized)."""
from __future__ import annotations

import transformers

from ..common.rules.published_plan import PublishedTPPlan


class GPTJConfig(transformers.GPTJConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.gptj.modeling_gptj", "GPTJ_SPEC")
