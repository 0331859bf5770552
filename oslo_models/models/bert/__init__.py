from .configuration_bert import BertConfig
from .modeling_bert import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
)
from .heads_bert import BertForMultipleChoice, BertForNextSentencePrediction, BertLMHeadModel
from .parallel_plan import BERT_BASE_PLAN, BERT_HEAD_PLAN, BERT_MLM_PLAN

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "BertPreTrainedModel", "BERT_BASE_PLAN",
           "BERT_MLM_PLAN", "BERT_HEAD_PLAN"]
__all__ += ["BertLMHeadModel", "BertForMultipleChoice", "BertForNextSentencePrediction"]
