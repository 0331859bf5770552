from ..llama.configuration_llama import MistralConfig
from .modeling_mistral import (
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
    MistralPreTrainedModel,
)

__all__ = ["MistralConfig", "MistralModel", "MistralForCausalLM", "MistralForSequenceClassification",
           "MistralForTokenClassification", "MistralForQuestionAnswering", "MistralPreTrainedModel"]
