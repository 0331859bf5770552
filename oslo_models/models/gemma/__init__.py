"""Gemma (1): thin classes over the Llama code (``models/llama``); the config classes of Gemma 1/2/3 live in
``configuration_gemma.py``."""
from ..family import WITHOUT_QA, FamilyRecord, decoder_classes, family_exports
from ..llama import TINY_DECODER

# The Gemma decoders' tiny models share these sizes: Llama's (8 query / 2 key-value heads, vocab 101) with
# head_dim=16 (not hidden/heads = 8), GeGLU, tied embeddings.
TINY_GEMMA = dict(TINY_DECODER, head_dim=16, tie_word_embeddings=True)

FAMILIES = (FamilyRecord(model_type="gemma", package=__name__, config="GemmaConfig",
                         classes=decoder_classes("Gemma", WITHOUT_QA),
                         tiny_config={**TINY_GEMMA, "hidden_act": "gelu_pytorch_tanh"}, spec="GEMMA_SPEC"),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
