"""Mistral: thin classes over the Llama code (``modeling_mistral.py``, ``models/llama``)."""
from ..family import FamilyRecord, decoder_classes, family_exports
from ..llama import TINY_DECODER

# Mistral's tiny model: a sliding window of 3, shorter than the test sequences, in every layer
FAMILIES = (FamilyRecord(model_type="mistral", package=__name__, config="MistralConfig", spec="LLAMA_SPEC",
                         classes=decoder_classes("Mistral"),
                         tiny_config={**TINY_DECODER, "sliding_window": 3}),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, config_from="llama", spec_from="llama")
