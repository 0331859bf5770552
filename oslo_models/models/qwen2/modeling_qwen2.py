"""Qwen2: the Llama decoder (``models/llama``) with biases on q/k/v (not on o, not in the MLP) and sliding-window
attention in the layers ``config.layer_types`` marks (``use_sliding_window``/``max_window_layers``). Only the class
names, the config class and the ``transformers`` twins differ, because ``config.json``'s ``architectures`` names
them."""
from __future__ import annotations

import transformers

from ..llama import modeling_llama as llama
from ..llama.configuration_llama import Qwen2Config


class Qwen2PreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = Qwen2Config

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return cls.switches(qkv_bias=True)


class Qwen2Model(Qwen2PreTrainedModel, llama.LlamaModel):
    hf_twin = transformers.Qwen2Model


class Qwen2ForCausalLM(Qwen2PreTrainedModel, llama.LlamaForCausalLM):
    hf_twin, base_model_class = transformers.Qwen2ForCausalLM, Qwen2Model


class Qwen2ForSequenceClassification(Qwen2PreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin, base_model_class = transformers.Qwen2ForSequenceClassification, Qwen2Model


class Qwen2ForTokenClassification(Qwen2PreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin, base_model_class = transformers.Qwen2ForTokenClassification, Qwen2Model


class Qwen2ForQuestionAnswering(Qwen2PreTrainedModel, llama.LlamaForQuestionAnswering):
    hf_twin, base_model_class = transformers.Qwen2ForQuestionAnswering, Qwen2Model
