"""Qwen2-MoE: a thin class over the Mixtral code (``models/mixtral``); its config class lives in
``mixtral/configuration_mixtral.py``."""
from ..family import FamilyRecord, decoder_classes, family_exports
from ..mixtral import TINY_MOE

FAMILIES = (
    FamilyRecord(model_type="qwen2_moe", package=__name__, config="Qwen2MoeConfig",
                 classes=decoder_classes("Qwen2Moe", ("base", "causal_lm")),
                 # layer 1 dense (mlp_only_layers), no top-k renormalization, a shared expert with its sigmoid gate
                 tiny_config={**TINY_MOE, "intermediate_size": 40, "moe_intermediate_size": 16,
                              "shared_expert_intermediate_size": 24, "num_hidden_layers": 3, "num_experts": 4,
                              "mlp_only_layers": [1], "norm_topk_prob": False},
                 spec="MOE_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, config_from="mixtral", spec_from="mixtral")
