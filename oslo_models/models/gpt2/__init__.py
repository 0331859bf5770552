from .configuration_gpt2 import GPT2Config
from .modeling_gpt2 import GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model, GPT2PreTrainedModel
from .modeling_gpt2 import GPT2ForQuestionAnswering, GPT2ForTokenClassification
from .parallel_plan import GPT2_BASE_PLAN, GPT2_HEAD_PLAN, GPT2_LM_PLAN

__all__ = ["GPT2Config", "GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2PreTrainedModel",
           "GPT2_BASE_PLAN", "GPT2_LM_PLAN", "GPT2_HEAD_PLAN"]
__all__ += ["GPT2ForTokenClassification", "GPT2ForQuestionAnswering"]
