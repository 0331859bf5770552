"""Mistral: a thin class over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``. Names are imported on first use (PEP 562): importing this package, as
``models.registry`` does to read ``FAMILIES``, imports no model code."""
from ..llama import thin_decoder_package

# Mistral's tiny model: a sliding window of 3, shorter than the test sequences, in every layer
FAMILIES, __getattr__, __dir__, __all__ = thin_decoder_package(__name__, "mistral", "Mistral", sliding_window=3)
