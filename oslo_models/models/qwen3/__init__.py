"""Qwen3: a thin class over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``. Names are imported on first use (PEP 562): importing this package, as
``models.registry`` does to read ``FAMILIES``, imports no model code."""
from ..llama import thin_decoder_package

# Qwen3's tiny model: q/k RMS norms, head_dim=12 (not hidden/heads), untied
FAMILIES, __getattr__, __dir__, __all__ = thin_decoder_package(__name__, "qwen3", "Qwen3", head_dim=12)
