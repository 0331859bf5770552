"""Mixtral and Qwen2-MoE configs: ``transformers``' own classes with this project's published tensor-parallel plan
(the experts are listed in ``transformers``' ``base_model_ep_plan`` of the parent class, kept as is)."""
from __future__ import annotations

import transformers

from .parallel_plan import published_tp_plan


class MixtralConfig(transformers.MixtralConfig):
    base_model_tp_plan = published_tp_plan()


class Qwen2MoeConfig(transformers.Qwen2MoeConfig):
    base_model_tp_plan = published_tp_plan()
