"""Qwen2: thin classes over the Llama code (``modeling_qwen2.py``); ``models/llama`` holds its config class and
its spec."""
from ..family import FamilyRecord, decoder_classes, family_exports
from ..llama import TINY_DECODER

# Qwen2's tiny model: q/k/v biases, tied embeddings, a sliding window on the layers past max_window_layers=1
FAMILIES = (FamilyRecord(model_type="qwen2", package=__name__, config="Qwen2Config", spec="LLAMA_SPEC",
                         classes=decoder_classes("Qwen2"),
                         tiny_config={**TINY_DECODER, "use_sliding_window": True, "sliding_window": 3,
                                      "max_window_layers": 1, "tie_word_embeddings": True}),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, config_from="llama", spec_from="llama")
