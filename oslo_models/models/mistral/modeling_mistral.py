"""Mistral: the Llama decoder (``models/llama``) with no biases and, when ``config.sliding_window`` is set,
sliding-window attention in every layer (read from the config by ``common.attention.causal_masks``). Only the class
names, the config class and the ``transformers`` twins differ, because ``config.json``'s ``architectures`` names
them."""
from __future__ import annotations

import transformers

from ..common.attention.causal_masks import every_layer_slides
from ..llama import modeling_llama as llama
from ..llama.configuration_llama import MistralConfig


class MistralPreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = MistralConfig

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return cls.switches()

    #: every layer slides when ``sliding_window`` is set; ``layer_types`` is ignored, as by ``MistralModel``
    attention_types = staticmethod(every_layer_slides)


class MistralModel(MistralPreTrainedModel, llama.LlamaModel):
    hf_twin = transformers.MistralModel


class MistralForCausalLM(MistralPreTrainedModel, llama.LlamaForCausalLM):
    hf_twin, base_model_class = transformers.MistralForCausalLM, MistralModel


class MistralForSequenceClassification(MistralPreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin, base_model_class = transformers.MistralForSequenceClassification, MistralModel


class MistralForTokenClassification(MistralPreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin, base_model_class = transformers.MistralForTokenClassification, MistralModel


class MistralForQuestionAnswering(MistralPreTrainedModel, llama.LlamaForQuestionAnswering):
    hf_twin, base_model_class = transformers.MistralForQuestionAnswering, MistralModel
    base_model_prefix = "model"
