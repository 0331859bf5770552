"""Switch Transformers config: ``transformers.SwitchTransformersConfig`` plus the published ``base_model_tp_plan``.

The T5 pieces this family is built on read ``scale_decoder_outputs`` (rescale the decoder output by
``d_model**-0.5`` before a tied head); Switch Transformers decides it by ``tie_word_embeddings``, as
``transformers``' ``SwitchTransformersForConditionalGeneration`` does. A read-only property, so ``config.json``
stays ``transformers``' own.
"""
from __future__ import annotations

import transformers

from .parallel_plan import SWITCH_PLAN


class SwitchTransformersConfig(transformers.SwitchTransformersConfig):
    base_model_tp_plan = SWITCH_PLAN.hf_tp_plan()

    @property
    def scale_decoder_outputs(self) -> bool:
        return bool(self.tie_word_embeddings)
