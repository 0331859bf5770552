from .configuration_roberta import RobertaConfig
from .modeling_roberta import (
    RobertaForMaskedLM,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaModel,
    RobertaPreTrainedModel,
)
from .modeling_roberta import RobertaForCausalLM, RobertaForMultipleChoice
from .parallel_plan import ROBERTA_BASE_PLAN, ROBERTA_HEAD_PLAN, ROBERTA_MLM_PLAN

__all__ = ["RobertaConfig", "RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
           "RobertaForTokenClassification", "RobertaForQuestionAnswering", "RobertaPreTrainedModel",
           "ROBERTA_BASE_PLAN", "ROBERTA_MLM_PLAN", "ROBERTA_HEAD_PLAN"]
__all__ += ["RobertaForCausalLM", "RobertaForMultipleChoice"]
