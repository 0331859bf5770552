"""Mixtral: the Llama-shaped decoder with mixture-of-experts feed-forwards (Qwen2-MoE is a thin class over it, in
its own folder; its config class lives in ``configuration_mixtral``)."""
from ..family import FamilyRecord, decoder_classes, family_exports

# The tiny mixture-of-experts decoders of the tests share these: 4 query / 2 key-value heads, top-2 routing, the
# router logits and aux loss (a large coefficient, so a wrong aux loss shows), vocab 61.
TINY_MOE = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True,
                router_aux_loss_coef=0.3, pad_token_id=0)
FAMILIES = (
    FamilyRecord(model_type="mixtral", package=__name__, config="MixtralConfig",
                 classes=decoder_classes("Mixtral", ("base", "causal_lm")),
                 tiny_config={**TINY_MOE, "intermediate_size": 24, "num_hidden_layers": 2, "num_local_experts": 4},
                 spec="MOE_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={".configuration_mixtral": ["Qwen2MoeConfig"]})
