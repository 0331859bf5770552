"""Qwen3-MoE: a thin class over the Mixtral / Qwen2-MoE code (``modeling_qwen3_moe.py``)."""
from ..family import FamilyRecord, decoder_classes, family_exports
from ..mixtral import TINY_MOE

# Qwen3-MoE's tiny model: q/k norms with head_dim 12 (not hidden/heads) and attention biases; layers 0 and 2 sparse,
# layer 1 dense (decoder_sparse_step=1 with mlp_only_layers=[1]); top-k renormalized (norm_topk_prob); the router
# logits and the load-balancing loss on (TINY_MOE).
FAMILIES = (
    FamilyRecord(model_type="qwen3_moe", package=__name__, config="Qwen3MoeConfig",
                 classes=decoder_classes("Qwen3Moe"),
                 tiny_config={**TINY_MOE, "intermediate_size": 40, "moe_intermediate_size": 16, "num_hidden_layers": 3,
                              "num_experts": 4, "mlp_only_layers": [1], "decoder_sparse_step": 1,
                              "norm_topk_prob": True, "head_dim": 12, "attention_bias": True},
                 spec="MOE_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, spec_from="mixtral")
