"""GPT-NeoX config: ``transformers.GPTNeoXConfig`` itself (same ``model_type``, same ``config.json``), plus the
published ``base_model_tp_plan`` read from ``GPT_NEOX_SPEC`` (a class attribute, never serialized)."""
from __future__ import annotations

import transformers

from ..common.rules.published_plan import PublishedTPPlan


class GPTNeoXConfig(transformers.GPTNeoXConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.gpt_neox.modeling_gpt_neox", "GPT_NEOX_SPEC")
