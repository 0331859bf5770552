"""Bloom: ALiBi positions (each tensor-parallel rank builds the bias of its own heads), an embedding LayerNorm and a
fused ``query_key_value`` packed per head, on the shared stack."""
from ..family import FamilyRecord, decoder_classes, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="bloom", package=__name__, config="BloomConfig",
        classes=decoder_classes("Bloom"),
        # 12 heads, not a power of two: the last 4 slopes come from the 16-head series (Bloom's rule), so at tp 2
        # rank 1 holds 2 slopes of one series and 4 of the other, and each rank's slopes differ
        tiny_config=dict(hidden_size=48, n_layer=2, n_head=12, vocab_size=101, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, hidden_dropout=0.0, attention_dropout=0.0),
        spec="BLOOM_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
