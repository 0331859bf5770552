"""Qwen2: a thin class over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``.

Names are imported on first use (PEP 562): importing this package, as ``models.registry`` does to read
``FAMILIES``, imports no model code."""
from ..family import lazy_exports
from ..llama import decoder_record

_EXPORTS = {
    "..llama.configuration_llama": ["Qwen2Config"],
    ".modeling_qwen2": ["Qwen2Model", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification",
                      "Qwen2ForTokenClassification", "Qwen2ForQuestionAnswering", "Qwen2PreTrainedModel"],
}
# Qwen2's tiny model: q/k/v biases, tied embeddings, a sliding window on the layers past max_window_layers=1
FAMILIES = (decoder_record("qwen2", __name__, "Qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1,
                           tie_word_embeddings=True),)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [name for names in _EXPORTS.values() for name in names]
