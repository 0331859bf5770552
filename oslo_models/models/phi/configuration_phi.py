"""Phi config: ``transformers.PhiConfig`` itself (same ``model_type``, same ``config.json``), plus the published
``base_model_tp_plan`` read from ``PHI_SPEC`` (a class attribute, never serialized)."""
from __future__ import annotations

import transformers

from ..common.rules.published_plan import PublishedTPPlan


class PhiConfig(transformers.PhiConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.phi.modeling_phi", "PHI_SPEC")
