"""T5 config: ``transformers.T5Config`` (``feed_forward_proj`` "relu" for T5, "gated-gelu" for T5 v1.1 /
Flan-T5; ``scale_decoder_outputs`` for the ``d_model**-0.5`` rescale of tied heads) plus the published
``base_model_tp_plan``."""
from __future__ import annotations

import transformers

from .parallel_plan import T5_PLAN


class T5Config(transformers.T5Config):
    base_model_tp_plan = T5_PLAN.hf_tp_plan()
