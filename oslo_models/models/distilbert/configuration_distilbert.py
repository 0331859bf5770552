"""DistilBERT config: ``transformers.DistilBertConfig`` itself plus the published ``base_model_tp_plan`` (derived
from ``DISTILBERT_SPEC``, ``modeling_distilbert.py``)."""
from __future__ import annotations

import transformers

from ..common.rules.published_plan import PublishedTPPlan


class DistilBertConfig(transformers.DistilBertConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.distilbert.modeling_distilbert", "DISTILBERT_SPEC")
