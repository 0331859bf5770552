from ..llama.configuration_llama import Qwen2Config
from .modeling_qwen2 import (
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
    Qwen2PreTrainedModel,
)

__all__ = ["Qwen2Config", "Qwen2Model", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification",
           "Qwen2ForTokenClassification", "Qwen2ForQuestionAnswering", "Qwen2PreTrainedModel"]
