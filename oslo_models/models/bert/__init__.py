from .configuration_bert import BertConfig
from .modeling_bert import (
    BERT_SPEC,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
    BertPreTrainedModel,
)

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "BertPreTrainedModel", "BertLMHeadModel",
           "BertForMultipleChoice", "BertForNextSentencePrediction", "BERT_SPEC"]
