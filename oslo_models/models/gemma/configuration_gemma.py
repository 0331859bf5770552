"""The Gemma-family configs: ``transformers``' own classes (same ``model_type``, same ``config.json``), each with the
published ``base_model_tp_plan`` of this project's plan, read from the family's ``StackSpec`` (a class attribute,
never serialized; see ``common/rules/published_plan.py``). Gemma 3's q/k norms are in its plan, Gemma 1/2 have none."""
from __future__ import annotations

import transformers

from ..common.rules.published_plan import PublishedTPPlan
from ..llama.parallel_plan import QK_NORMS


class GemmaConfig(transformers.GemmaConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.gemma.modeling_gemma", "GEMMA_SPEC", drop=QK_NORMS)


class Gemma2Config(transformers.Gemma2Config):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.gemma2.modeling_gemma2", "GEMMA2_SPEC", drop=QK_NORMS)


class Gemma3TextConfig(transformers.Gemma3TextConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.gemma3_text.modeling_gemma3_text", "GEMMA3_SPEC")
