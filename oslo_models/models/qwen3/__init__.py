"""Qwen3: thin classes over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``. Names are imported on first use (PEP 562): importing this package, as
``models.registry`` does to read ``FAMILIES``, imports no model code."""
from ..family import FamilyRecord, family_exports
from ..llama import TINY_DECODER

_EXPORTS = {
    "..llama.configuration_llama": ["Qwen3Config"],
    "..llama.modeling_llama": ["LLAMA_SPEC"],
    ".modeling_qwen3": ["Qwen3Model", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
                       "Qwen3ForTokenClassification", "Qwen3ForQuestionAnswering", "Qwen3PreTrainedModel"],
}
# Qwen3's tiny model: q/k RMS norms, head_dim=12 (not hidden/heads), untied
FAMILIES = (FamilyRecord(model_type="qwen3", package=__name__, config="Qwen3Config", spec="LLAMA_SPEC",
                         classes={"base": "Qwen3Model", "causal_lm": "Qwen3ForCausalLM",
                                  "sequence_classification": "Qwen3ForSequenceClassification",
                                  "token_classification": "Qwen3ForTokenClassification",
                                  "question_answering": "Qwen3ForQuestionAnswering"},
                         tiny_config={**TINY_DECODER, "head_dim": 12}),)

__getattr__, __dir__, __all__ = family_exports(__name__, _EXPORTS)
