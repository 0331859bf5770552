"""Qwen3 (``modeling_qwen3.py``): the Llama code with q/k norms; config class and spec in ``models/llama``."""
from ..family import FamilyRecord, decoder_classes, family_exports
from ..llama import TINY_DECODER

# Qwen3's tiny model: q/k RMS norms, head_dim=12 (not hidden/heads), untied
FAMILIES = (FamilyRecord(model_type="qwen3", package=__name__, config="Qwen3Config", spec="LLAMA_SPEC",
                         classes=decoder_classes("Qwen3"),
                         tiny_config={**TINY_DECODER, "head_dim": 12}),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, config_from="llama", spec_from="llama")
