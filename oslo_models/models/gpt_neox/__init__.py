"""GPT-NeoX (Pythia, GPT-NeoX-20B): q|k|v packed per head, partial rotary (``rotary_pct``), parallel or sequential
residual (``use_parallel_residual``), on the shared stack."""
from ..family import FamilyRecord, decoder_classes, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="gpt_neox", package=__name__, config="GPTNeoXConfig",
        classes=decoder_classes("GPTNeoX"),
        # rotary_pct 0.5: 4 of the 8 dims of each head rotate; parallel residual with two norms (the sequential
        # block: tests/models/test_decoder_families_neox.py); biased q|k|v and dense; untied embed_out; no dropout
        tiny_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         vocab_size=101, max_position_embeddings=64, rotary_pct=0.5, use_parallel_residual=True,
                         attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0, hidden_act="gelu",
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        spec="GPT_NEOX_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={".modeling_gpt_neox": ["GPTNeoXLayer"]})
