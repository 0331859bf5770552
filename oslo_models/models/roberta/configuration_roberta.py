"""RoBERTa config: ``transformers.RobertaConfig`` plus the published ``base_model_tp_plan``."""
from __future__ import annotations

import transformers

from .parallel_plan import published_tp_plan


class RobertaConfig(transformers.RobertaConfig):
    base_model_tp_plan = published_tp_plan()
