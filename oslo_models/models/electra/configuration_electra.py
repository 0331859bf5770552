"""ELECTRA config: ``transformers.ElectraConfig`` itself plus the published ``base_model_tp_plan``
(``ELECTRA_SPEC``'s: BERT's layers and the embedding projection, see ``modeling_electra.py``)."""
from __future__ import annotations

import transformers

from ..common.rules.published_plan import PublishedTPPlan


class ElectraConfig(transformers.ElectraConfig):
    base_model_tp_plan = PublishedTPPlan("oslo_models.models.electra.modeling_electra", "ELECTRA_SPEC")
