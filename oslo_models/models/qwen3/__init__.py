"""Qwen3: a thin class over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``.

Names are imported on first use (PEP 562): importing this package, as ``models.registry`` does to read
``FAMILIES``, imports no model code."""
from ..family import lazy_exports
from ..llama import decoder_record

_EXPORTS = {
    "..llama.configuration_llama": ["Qwen3Config"],
    ".modeling_qwen3": ["Qwen3Model", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
                      "Qwen3ForTokenClassification", "Qwen3ForQuestionAnswering", "Qwen3PreTrainedModel"],
}
# Qwen3's tiny model: q/k RMS norms, head_dim=12 (not hidden/heads), untied
FAMILIES = (decoder_record("qwen3", __name__, "Qwen3", head_dim=12),)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [name for names in _EXPORTS.values() for name in names]
