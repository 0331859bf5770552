from .configuration_gpt2 import GPT2Config
from .modeling_gpt2 import (
    GPT2_SPEC,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    GPT2PreTrainedModel,
)

__all__ = ["GPT2Config", "GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2PreTrainedModel",
           "GPT2ForTokenClassification", "GPT2ForQuestionAnswering", "GPT2_SPEC"]
