"""mT5: T5 v1.1's architecture and Hub keys under its own ``model_type`` (``"mt5"``).

``transformers`` gives mT5 its own ``MT5Config`` (T5's fields) and classes (``MT5ForConditionalGeneration``, ...;
T5's module tree and keys, gated-GELU feed-forward, a separate ``lm_head`` read from the checkpoint, and no
``d_model**-0.5`` rescale of the decoder output). Here each is the T5 class with that config class and that twin,
under the twin's class name, so ``save_pretrained`` writes ``model_type="mt5"`` and the mT5 ``architectures``.
Plans, pipeline adapter, shapes and collectives are T5's.
"""
from __future__ import annotations

import transformers

from .modeling_t5 import T5EncoderModel, T5ForConditionalGeneration, T5Model
from .parallel_plan import T5_PLAN


class MT5Config(transformers.MT5Config):
    base_model_tp_plan = T5_PLAN.hf_tp_plan()
    # transformers' mT5 never rescales the decoder output before the head (T5Config decides it per checkpoint);
    # a class attribute, so config.json stays transformers' own.
    scale_decoder_outputs = False


class MT5Model(T5Model):
    config_class = MT5Config
    hf_twin = transformers.MT5Model


class MT5ForConditionalGeneration(T5ForConditionalGeneration):
    config_class = MT5Config
    hf_twin = transformers.MT5ForConditionalGeneration


class MT5EncoderModel(T5EncoderModel):
    config_class = MT5Config
    hf_twin = transformers.MT5EncoderModel
