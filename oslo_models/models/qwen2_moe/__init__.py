"""Qwen2-MoE: a thin class over the Mixtral code (``models/mixtral``); its config class lives in
``mixtral/configuration_mixtral.py``.

Names are imported on first use (PEP 562): importing this package, as ``models.registry`` does to read
``FAMILIES``, imports no model code."""
from ..family import FamilyRecord, decoder_classes, family_exports
from ..mixtral import TINY_MOE

_EXPORTS = {
    "..mixtral.configuration_mixtral": ["Qwen2MoeConfig"],
    ".modeling_qwen2_moe": ["Qwen2MoeModel", "Qwen2MoeForCausalLM", "Qwen2MoePreTrainedModel"],
    "..mixtral.modeling_mixtral": ["MOE_SPEC"],
}
FAMILIES = (
    FamilyRecord(model_type="qwen2_moe", package=__name__, config="Qwen2MoeConfig",
                 classes=decoder_classes("Qwen2Moe", ("base", "causal_lm")),
                 # layer 1 dense (mlp_only_layers), no top-k renormalization, a shared expert with its sigmoid gate
                 tiny_config={**TINY_MOE, "intermediate_size": 40, "moe_intermediate_size": 16,
                              "shared_expert_intermediate_size": 24, "num_hidden_layers": 3, "num_experts": 4,
                              "mlp_only_layers": [1], "norm_topk_prob": False},
                 spec="MOE_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, _EXPORTS)
