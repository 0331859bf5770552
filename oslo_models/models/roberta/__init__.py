"""RoBERTa (BERT's encoder with RoBERTa's embeddings) and, under their own ``model_type``, XLM-RoBERTa and CamemBERT
(``variants.py``: RoBERTa's classes with their own config classes and class names)."""
from ..bert import TINY_ENCODER
from ..family import FamilyRecord, family_exports

# the tiny BERT with RoBERTa's special tokens (padding 1; positions start after it)
_TINY = {**TINY_ENCODER, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}

FAMILIES = (
    FamilyRecord(model_type="roberta", package=__name__, config="RobertaConfig", tiny_config=_TINY, classes={
        "base": "RobertaModel", "masked_lm": "RobertaForMaskedLM",
        "sequence_classification": "RobertaForSequenceClassification",
        "token_classification": "RobertaForTokenClassification", "question_answering": "RobertaForQuestionAnswering",
        "causal_lm": "RobertaForCausalLM", "multiple_choice": "RobertaForMultipleChoice"}, spec="ROBERTA_SPEC"),
    FamilyRecord(model_type="xlm-roberta", package=__name__, config="XLMRobertaConfig", tiny_config=_TINY, classes={
        "base": "XLMRobertaModel", "masked_lm": "XLMRobertaForMaskedLM",
        "sequence_classification": "XLMRobertaForSequenceClassification",
        "token_classification": "XLMRobertaForTokenClassification",
        "question_answering": "XLMRobertaForQuestionAnswering"}, spec="ROBERTA_SPEC"),
    FamilyRecord(model_type="camembert", package=__name__, config="CamembertConfig", tiny_config=_TINY, classes={
        "base": "CamembertModel", "masked_lm": "CamembertForMaskedLM",
        "sequence_classification": "CamembertForSequenceClassification",
        "token_classification": "CamembertForTokenClassification",
        "question_answering": "CamembertForQuestionAnswering"}, spec="ROBERTA_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, others=".variants")
