from .configuration_llama import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from .modeling_llama import (
    LLAMA_SPEC,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    LlamaPreTrainedModel,
)

__all__ = ["LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "LlamaDecoderLayer", "LlamaForCausalLM",
           "LlamaForQuestionAnswering", "LlamaForSequenceClassification", "LlamaForTokenClassification", "LlamaModel",
           "LlamaPreTrainedModel", "LLAMA_SPEC"]
