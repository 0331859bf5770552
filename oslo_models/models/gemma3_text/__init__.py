"""Gemma 3 (text): thin classes over the Gemma 2 code (``models/gemma2``); its config class lives in
``gemma/configuration_gemma.py``."""
from ..family import FamilyRecord, family_exports
from ..gemma import TINY_GEMMA

# Gemma 3's tiny model: layer 0 local (sliding window 3, shorter than the 8-token test sequences; rotary base 100),
# layer 1 global (base 10000 with linear scaling x2): two rotary embeddings that differ; q/k norms; a final logit
# soft-cap that caps (most logits exceed half of 1.0 at initializer_range 0.1); query_pre_attn_scalar=24
TINY_GEMMA3 = dict(TINY_GEMMA, hidden_activation="gelu_pytorch_tanh", sliding_window=3, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=1.0,
                   initializer_range=0.1,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})

FAMILIES = (FamilyRecord(model_type="gemma3_text", package=__name__, config="Gemma3TextConfig",
                         classes={"base": "Gemma3TextModel", "causal_lm": "Gemma3ForCausalLM",
                                  "sequence_classification": "Gemma3TextForSequenceClassification"},
                         tiny_config=TINY_GEMMA3, spec="GEMMA3_SPEC"),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, config_from="gemma", also={
    ".modeling_gemma3_text": ["Gemma3DecoderLayer", "Gemma3RotaryEmbedding"]})
