"""RoBERTa config: ``transformers.RobertaConfig`` plus the published ``base_model_tp_plan``."""
from __future__ import annotations

import transformers

from .parallel_plan import ROBERTA_BASE_PLAN


class RobertaConfig(transformers.RobertaConfig):
    base_model_tp_plan = ROBERTA_BASE_PLAN.hf_tp_plan()
