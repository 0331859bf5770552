"""Gemma 2: thin classes over the Gemma code (``models/gemma``); its config class lives in
``gemma/configuration_gemma.py``."""
from ..family import WITHOUT_QA, FamilyRecord, decoder_classes, family_exports
from ..gemma import TINY_GEMMA

# Gemma 2's tiny model: a sliding window of 3 (shorter than the 8-token test sequences) on layer 0, full attention
# on layer 1; query_pre_attn_scalar=24 (not head_dim=16); soft caps small enough that they cap (at initializer_range
# 0.1 most attention scores exceed half the cap of 0.5 and most logits half the cap of 1.0)
TINY_GEMMA2 = dict(TINY_GEMMA, hidden_activation="gelu_pytorch_tanh", sliding_window=3, query_pre_attn_scalar=24,
                   attn_logit_softcapping=0.5, final_logit_softcapping=1.0, initializer_range=0.1)

FAMILIES = (FamilyRecord(model_type="gemma2", package=__name__, config="Gemma2Config",
                         classes=decoder_classes("Gemma2", WITHOUT_QA),
                         tiny_config=TINY_GEMMA2, spec="GEMMA2_SPEC"),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, config_from="gemma", also={
    ".modeling_gemma2": ["Gemma2DecoderLayer"]})
