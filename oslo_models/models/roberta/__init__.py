"""RoBERTa (BERT's encoder with RoBERTa's embeddings) and, under their own ``model_type``, XLM-RoBERTa and CamemBERT
(``variants.py``: RoBERTa's classes with their own config classes and class names).

Names are imported on first use (PEP 562): importing this package, as ``models.registry`` does to read
``FAMILIES``, imports no model code."""
from ..bert import TINY_ENCODER
from ..family import FamilyRecord, lazy_exports

_VARIANT_HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                  "ForQuestionAnswering")
_EXPORTS = {
    ".configuration_roberta": ["RobertaConfig"],
    ".modeling_roberta": ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
                          "RobertaForTokenClassification", "RobertaForQuestionAnswering", "RobertaPreTrainedModel",
                          "RobertaForCausalLM", "RobertaForMultipleChoice"],
    "..bert.modeling_bert": ["BERT_SPEC"],
    ".variants": [f"{prefix}{suffix}" for prefix in ("XLMRoberta", "Camembert")
                  for suffix in ("Config", *_VARIANT_HEADS)],
}
# the tiny BERT with RoBERTa's special tokens (padding 1; positions start after it)
_TINY = {**TINY_ENCODER, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
_VARIANT_TASKS = ("base", "masked_lm", "sequence_classification", "token_classification", "question_answering")


def _variant(model_type: str, prefix: str) -> FamilyRecord:
    return FamilyRecord(model_type=model_type, package=__name__, config=f"{prefix}Config", tiny_config=_TINY,
                        classes={task: prefix + suffix for task, suffix in zip(_VARIANT_TASKS, _VARIANT_HEADS)},
                        spec="BERT_SPEC")


FAMILIES = (
    FamilyRecord(model_type="roberta", package=__name__, config="RobertaConfig", tiny_config=_TINY, classes={
        "base": "RobertaModel", "masked_lm": "RobertaForMaskedLM",
        "sequence_classification": "RobertaForSequenceClassification",
        "token_classification": "RobertaForTokenClassification", "question_answering": "RobertaForQuestionAnswering",
        "causal_lm": "RobertaForCausalLM", "multiple_choice": "RobertaForMultipleChoice"}, spec="BERT_SPEC"),
    _variant("xlm-roberta", "XLMRoberta"),
    _variant("camembert", "Camembert"),
)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [name for names in _EXPORTS.values() for name in names]
