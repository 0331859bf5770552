from ..llama.configuration_llama import Qwen3Config
from .modeling_qwen3 import (
    Qwen3ForCausalLM,
    Qwen3ForQuestionAnswering,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
    Qwen3Model,
    Qwen3PreTrainedModel,
)

__all__ = ["Qwen3Config", "Qwen3Model", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
           "Qwen3ForTokenClassification", "Qwen3ForQuestionAnswering", "Qwen3PreTrainedModel"]
