"""Qwen3: the Llama decoder (``models/llama``) with RMS norms on the query and key heads (``q_norm``/``k_norm``
over ``head_dim``, before rotary), ``attention_bias`` on q/k/v/o, and sliding-window attention in the layers
``config.layer_types`` marks. Only the class names, the config class and the ``transformers`` twins differ,
because ``config.json``'s ``architectures`` names them."""
from __future__ import annotations

import transformers

from ..llama import modeling_llama as llama
from ..llama.configuration_llama import Qwen3Config


class Qwen3PreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = Qwen3Config

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return cls.biased_switches(config, qk_norm=True)


class Qwen3Model(Qwen3PreTrainedModel, llama.LlamaModel):
    hf_twin = transformers.Qwen3Model


class Qwen3ForCausalLM(Qwen3PreTrainedModel, llama.LlamaForCausalLM):
    hf_twin, base_model_class = transformers.Qwen3ForCausalLM, Qwen3Model


class Qwen3ForSequenceClassification(Qwen3PreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin, base_model_class = transformers.Qwen3ForSequenceClassification, Qwen3Model


class Qwen3ForTokenClassification(Qwen3PreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin, base_model_class = transformers.Qwen3ForTokenClassification, Qwen3Model


class Qwen3ForQuestionAnswering(Qwen3PreTrainedModel, llama.LlamaForQuestionAnswering):
    hf_twin, base_model_class = transformers.Qwen3ForQuestionAnswering, Qwen3Model
