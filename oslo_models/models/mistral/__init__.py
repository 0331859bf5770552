"""Mistral: thin classes over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``. Names are imported on first use (PEP 562): importing this package, as
``models.registry`` does to read ``FAMILIES``, imports no model code."""
from ..family import FamilyRecord, family_exports
from ..llama import TINY_DECODER

_EXPORTS = {
    "..llama.configuration_llama": ["MistralConfig"],
    "..llama.modeling_llama": ["LLAMA_SPEC"],
    ".modeling_mistral": ["MistralModel", "MistralForCausalLM", "MistralForSequenceClassification",
                       "MistralForTokenClassification", "MistralForQuestionAnswering", "MistralPreTrainedModel"],
}
# Mistral's tiny model: a sliding window of 3, shorter than the test sequences, in every layer
FAMILIES = (FamilyRecord(model_type="mistral", package=__name__, config="MistralConfig", spec="LLAMA_SPEC",
                         classes={"base": "MistralModel", "causal_lm": "MistralForCausalLM",
                                  "sequence_classification": "MistralForSequenceClassification",
                                  "token_classification": "MistralForTokenClassification",
                                  "question_answering": "MistralForQuestionAnswering"},
                         tiny_config={**TINY_DECODER, "sliding_window": 3}),)

__getattr__, __dir__, __all__ = family_exports(__name__, _EXPORTS)
