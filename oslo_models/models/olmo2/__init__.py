"""OLMo 2: declared on the Llama code (``models/llama``) from its config class and ``OLMO2_SPEC``."""
from ..family import FamilyRecord, decoder_classes, family_exports
from ..llama import TINY_DECODER

# OLMo 2's tiny model: Llama's sizes (8 query / 2 key-value heads: at tp=4 each key head, and its slice of the
# full-width k_norm, is replicated on two ranks), untied embeddings
FAMILIES = (FamilyRecord(model_type="olmo2", package=__name__, config="Olmo2Config",
                         classes=decoder_classes("Olmo2", ("base", "causal_lm", "sequence_classification")),
                         tiny_config={**TINY_DECODER, "tie_word_embeddings": False}, spec="OLMO2_SPEC"),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={".modeling_olmo2": ["Olmo2DecoderLayer"]})
