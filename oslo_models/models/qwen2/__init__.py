"""Qwen2: thin classes over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``. Names are imported on first use (PEP 562): importing this package, as
``models.registry`` does to read ``FAMILIES``, imports no model code."""
from ..family import FamilyRecord, family_exports
from ..llama import TINY_DECODER

_EXPORTS = {
    "..llama.configuration_llama": ["Qwen2Config"],
    "..llama.modeling_llama": ["LLAMA_SPEC"],
    ".modeling_qwen2": ["Qwen2Model", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification",
                       "Qwen2ForTokenClassification", "Qwen2ForQuestionAnswering", "Qwen2PreTrainedModel"],
}
# Qwen2's tiny model: q/k/v biases, tied embeddings, a sliding window on the layers past max_window_layers=1
FAMILIES = (FamilyRecord(model_type="qwen2", package=__name__, config="Qwen2Config", spec="LLAMA_SPEC",
                         classes={"base": "Qwen2Model", "causal_lm": "Qwen2ForCausalLM",
                                  "sequence_classification": "Qwen2ForSequenceClassification",
                                  "token_classification": "Qwen2ForTokenClassification",
                                  "question_answering": "Qwen2ForQuestionAnswering"},
                         tiny_config={**TINY_DECODER, "use_sliding_window": True, "sliding_window": 3,
                                      "max_window_layers": 1, "tie_word_embeddings": True}),)

__getattr__, __dir__, __all__ = family_exports(__name__, _EXPORTS)
