"""Mistral: a thin class over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``.

Names are imported on first use (PEP 562): importing this package, as ``models.registry`` does to read
``FAMILIES``, imports no model code."""
from ..family import lazy_exports
from ..llama import decoder_record

_EXPORTS = {
    "..llama.configuration_llama": ["MistralConfig"],
    ".modeling_mistral": ["MistralModel", "MistralForCausalLM", "MistralForSequenceClassification",
                      "MistralForTokenClassification", "MistralForQuestionAnswering", "MistralPreTrainedModel"],
}
# Mistral's tiny model: a sliding window of 3, shorter than the test sequences, in every layer
FAMILIES = (decoder_record("mistral", __name__, "Mistral", sliding_window=3),)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [name for names in _EXPORTS.values() for name in names]
