"""ELECTRA config: ``transformers.ElectraConfig`` itself plus the published ``base_model_tp_plan`` (BERT's: the
layers are BERT's, see ``modeling_electra.py``)."""
from __future__ import annotations

import transformers

from ..bert.parallel_plan import published_tp_plan


class ElectraConfig(transformers.ElectraConfig):
    base_model_tp_plan = published_tp_plan()
