"""Qwen2: a thin class over the Llama code (``models/llama``); its config class lives in
``llama/configuration_llama.py``. Names are imported on first use (PEP 562): importing this package, as
``models.registry`` does to read ``FAMILIES``, imports no model code."""
from ..llama import thin_decoder_package

# Qwen2's tiny model: q/k/v biases, tied embeddings, a sliding window on the layers past max_window_layers=1
FAMILIES, __getattr__, __dir__, __all__ = thin_decoder_package(
    __name__, "qwen2", "Qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1,
    tie_word_embeddings=True)
