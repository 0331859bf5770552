"""ALBERT config: ``transformers.AlbertConfig`` itself plus the published ``base_model_tp_plan`` (derived from
``ALBERT_SPEC``, ``modeling_albert.py``)."""
from __future__ import annotations

import transformers

from ..common.rules.published_plan import PublishedTPPlan


class AlbertConfig(transformers.AlbertConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.albert.modeling_albert", "ALBERT_SPEC")
