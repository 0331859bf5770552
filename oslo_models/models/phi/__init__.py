"""Phi (phi-1, phi-1.5, phi-2): parallel residual with one LayerNorm, partial rotary, optional per-head q/k layer
norms (``qk_layernorm``), biased ``dense`` and ``lm_head``, on the shared stack."""
from ..family import WITHOUT_QA, FamilyRecord, decoder_classes, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="phi", package=__name__, config="PhiConfig",
        classes=decoder_classes("Phi", WITHOUT_QA),
        # partial rotary (4 of 8 dims), q/k layer norms on, 8 query / 2 key-value heads (tp=4 replicates key/value
        # heads), biased lm_head; no dropout (qk_layernorm off: tests/models/test_decoder_families_neox.py)
        tiny_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=64,
                         partial_rotary_factor=0.5, qk_layernorm=True, resid_pdrop=0.0, embd_pdrop=0.0,
                         attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2),
        spec="PHI_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={".modeling_phi": ["PhiDecoderLayer"]})
