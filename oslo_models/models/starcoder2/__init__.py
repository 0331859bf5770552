"""StarCoder2: LayerNorms with biases, grouped-query attention with biases and a sliding window, a biased two-layer
MLP, residual and embedding dropouts (``modeling_starcoder2.py``)."""
from ..family import WITHOUT_QA, FamilyRecord, decoder_classes, family_exports

# StarCoder2's tiny model: 8 query / 2 key-value heads, biases everywhere (use_bias), a sliding window of 3 (shorter
# than the tests' sequences) in every layer, tied embeddings (transformers' default for the type). The dropouts are
# 0 here (the zoo compares training-mode outputs); the family test draws them against transformers with one seed.
FAMILIES = (
    FamilyRecord(model_type="starcoder2", package=__name__, config="Starcoder2Config",
                 classes=decoder_classes("Starcoder2", WITHOUT_QA),
                 tiny_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                                  num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, use_bias=True, sliding_window=3,
                                  residual_dropout=0.0, embedding_dropout=0.0),
                 spec="STARCODER2_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES,
                                               also={".modeling_starcoder2": ["Starcoder2DecoderLayer"]})
