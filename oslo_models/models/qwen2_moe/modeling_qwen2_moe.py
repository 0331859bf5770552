"""Qwen2-MoE: the Mixtral code (``models/mixtral``) with Qwen2-MoE's switches: a shared expert with a sigmoid gate
in every sparse block, dense ``Qwen2MoeMLP`` layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so,
top-k renormalization only with ``norm_topk_prob``, routing weights cast to the logits' dtype, q/k/v biases
(``qkv_bias``) and sliding windows per ``config.layer_types``."""
from __future__ import annotations

import transformers

from ..common.loading.expert_keys import ExpertKeyLayout
from ..mixtral import modeling_mixtral as mixtral
from ..mixtral.configuration_mixtral import Qwen2MoeConfig


class Qwen2MoePreTrainedModel(mixtral.MixtralPreTrainedModel):
    config_class = Qwen2MoeConfig
    expert_key_layout = ExpertKeyLayout()  # mlp.experts.N.gate_proj/up_proj/down_proj

    @classmethod
    def decoder_options(cls, config) -> mixtral.MoeOptions:
        moe = mixtral.moe_switches(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                                   intermediate_size=config.moe_intermediate_size, act=config.hidden_act,
                                   normalize=config.norm_topk_prob, weights_in_logits_dtype=True,
                                   shared_expert_intermediate_size=config.shared_expert_intermediate_size)
        return cls.switches(qkv_bias=bool(getattr(config, "qkv_bias", True)), moe=moe,
                            sparse_layers=cls.sparse_layers(config), dense_intermediate_size=config.intermediate_size)

    @classmethod
    def sparse_layers(cls, config) -> frozenset[int]:
        """The layers with a sparse block (the others a dense MLP): not in ``mlp_only_layers``, and every
        ``decoder_sparse_step``-th (``transformers``' Qwen2-MoE / Qwen3-MoE rule)."""
        return frozenset(i for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers
                         and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0)

    @classmethod
    def num_experts(cls, config) -> int:
        return config.num_experts


class Qwen2MoeModel(Qwen2MoePreTrainedModel, mixtral.MixtralModel):
    hf_twin = transformers.Qwen2MoeModel


class Qwen2MoeForCausalLM(Qwen2MoePreTrainedModel, mixtral.MixtralForCausalLM):
    hf_twin, base_model_class = transformers.Qwen2MoeForCausalLM, Qwen2MoeModel
