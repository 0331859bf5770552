"""Phi-3: the Llama decoder with a fused grouped-query ``qkv_proj``, a fused ``gate_up_proj``, partial / longrope
rotary and residual dropouts (``modeling_phi3.py``)."""
from ..family import WITHOUT_QA, FamilyRecord, decoder_classes, family_exports
from ..llama import TINY_DECODER

# Phi-3's tiny model: q|k|v blocks of 8, 1 and 1 heads (unequal; tp=2 replicates the key/value head), half the head
# rotary (head_dim 8, rotary 4), longrope whose long factors take over past 6 positions (inside the tests' 8-token
# sequences and decode loops), so short and long factors and the attention factor of 64/6 all act.
FAMILIES = (
    FamilyRecord(model_type="phi3", package=__name__, config="Phi3Config",
                 classes=decoder_classes("Phi3", WITHOUT_QA),
                 tiny_config={**TINY_DECODER, "num_key_value_heads": 1, "original_max_position_embeddings": 6,
                              "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.25],
                                                  "long_factor": [2.0, 3.5]}},
                 spec="PHI3_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={".modeling_phi3": ["Phi3DecoderLayer"]})
