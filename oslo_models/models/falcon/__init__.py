"""Falcon: both architectures (``new_decoder_architecture``: grouped key/value heads; the old one: multi-query with
one key/value head replicated over tensor-parallel ranks, or per-head q|k|v), parallel or sequential residual,
rotary or ALiBi positions, on the shared stack."""
from ..family import FamilyRecord, decoder_classes, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="falcon", package=__name__, config="FalconConfig",
        classes=decoder_classes("Falcon"),
        # the new architecture: 2 key/value groups of 4 query heads packed [q q q q k v] (tp 2: a group per rank;
        # tp 4: each group's key/value head replicated on 2 ranks), ln_attn + ln_mlp, biases, rotary; the other
        # switches (multi-query, sequential block, ALiBi) are in tests/models/test_decoder_families_alibi.py
        tiny_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_kv_heads=2,
                         new_decoder_architecture=True, bias=True, ffn_hidden_size=96, vocab_size=101,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        spec="FALCON_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
