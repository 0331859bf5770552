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
from .variants import (
    CamembertConfig,
    CamembertForMaskedLM,
    CamembertForQuestionAnswering,
    CamembertForSequenceClassification,
    CamembertForTokenClassification,
    CamembertModel,
    XLMRobertaConfig,
    XLMRobertaForMaskedLM,
    XLMRobertaForQuestionAnswering,
    XLMRobertaForSequenceClassification,
    XLMRobertaForTokenClassification,
    XLMRobertaModel,
)

__all__ = ["RobertaConfig", "RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
           "RobertaForTokenClassification", "RobertaForQuestionAnswering", "RobertaPreTrainedModel"]
__all__ += ["XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForMaskedLM", "XLMRobertaForSequenceClassification",
            "XLMRobertaForTokenClassification", "XLMRobertaForQuestionAnswering", "CamembertConfig", "CamembertModel",
            "CamembertForMaskedLM", "CamembertForSequenceClassification", "CamembertForTokenClassification",
            "CamembertForQuestionAnswering"]
__all__ += ["RobertaForCausalLM", "RobertaForMultipleChoice"]
