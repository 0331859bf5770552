"""DeepSeek-V3: the Llama-shaped MoE decoder (``models/mixtral``) with DeepSeek's two components:

- attention: multi-head latent attention (``common.attention.latent_attention.MultiHeadLatentAttention``: low-rank q
  with ``q_lora_rank`` or a plain ``q_proj``, joint compressed key/value, rotary part split from the rest,
  ``v_head_dim`` values; yarn's ``mscale`` on the score scale, ``rope_interleave``);
- feed-forward: ``common.feed_forward.moe_variants.SharedExpertsMoe`` (sigmoid router with ``e_score_correction_bias``,
  group-limited top-k over ``n_group`` groups, ``routed_scaling_factor``, ``norm_topk_prob``; shared experts) in
  layers ``>= first_k_dense_replace``, a dense SwiGLU MLP (``intermediate_size``) before them.

Rotary: ``RotaryEmbedding`` (``transformers``' own module and rope init functions, yarn included) over
``head_dim = qk_rope_head_dim``. Norms: Llama's RMS formula (the latent norms use eps 1e-6, as ``transformers``).

Router outputs as ``transformers``: ``router_logits`` (fp32 ``[b*s, E]`` per sparse layer) with
``output_router_logits``; ``DeepseekV3ForCausalLM`` adds *no* auxiliary loss (``aux_loss`` is ``None``): the
balancing is the correction bias, which ``transformers`` keeps as a frozen buffer (loaded, saved, never trained;
see ``parallel_layers/moe/router_variants.py``), and so does this project.

Checkpoints: the per-expert Hub layout ``mlp.experts.N.gate_proj/up_proj/down_proj`` (``transformers``' Qwen2-MoE
conversion mapping, which it uses for this type), read per rank (only its experts) and written back the same.

Parallelism: attention heads over ``tp`` (MLA's plan fragment), experts over ``ep`` (all-to-all dispatch/combine)
and optionally each expert over ``etp``, the shared experts and dense MLPs column/row-parallel; sequence parallelism
(the routed part sees the whole sequence, ``moe.route_tokens``); ZeRO 1-3 with experts over the
expert-data-parallel group. Pipeline stages are the shared stack's (no router loss to carry), with tp and ep.
Refused, with the reason: context parallelism (MLA's rule).
"""
from __future__ import annotations

import dataclasses

import transformers
from transformers.utils.output_capturing import OutputRecorder

from ...parallel_layers.moe.router_variants import GroupLimitedRouter
from ..common.attention.latent_attention import MultiHeadLatentAttention
from ..common.feed_forward.mlp import GatedMLP
from ..common.feed_forward.moe_variants import SharedExpertsMoe
from ..common.loading.expert_keys import ExpertKeyLayout
from ..common.pipeline.pipeline_stack import StackPipelineAdapter
from ..common.rules.capabilities import Capabilities
from ..llama import modeling_llama as llama
from ..mixtral import modeling_mixtral as mixtral
from .configuration_deepseek_v3 import DeepseekV3Config

DEEPSEEK_V3_SPEC = dataclasses.replace(
    mixtral.MOE_SPEC, components={**mixtral.MOE_SPEC.components, "attn": MultiHeadLatentAttention,
                                  "mlp": (SharedExpertsMoe, GatedMLP)})


class DeepseekV3PreTrainedModel(mixtral.MixtralPreTrainedModel):
    config_class = DeepseekV3Config
    stack_spec = DEEPSEEK_V3_SPEC
    expert_key_layout = ExpertKeyLayout()  # mlp.experts.N.gate_proj/up_proj/down_proj
    record_outputs = {"router_logits": OutputRecorder(GroupLimitedRouter, index=0)}
    # the router (its weight and correction bias) stays fp32 in half-precision models, as transformers'
    # ["e_score_correction_bias", "gate.weight"] keeps it; here the patterns name modules
    _keep_in_fp32_modules_strict = ["gate"]

    # its MoE block routes like SparseMoeBlock (moe.route_tokens): sequence parallelism and pipeline x tp/ep run;
    # context parallelism: MLA's keys/values go through the cores; no router loss to reduce (as transformers)
    # moe_grid: its router is not the grid-planned TopKRouter, the 2D grid is refused
    capabilities = Capabilities(moe_sequence_parallel=True, moe_grid=False, moe_context_parallel=True)

    @classmethod
    def expert_intermediate_size(cls, config) -> int:
        return config.moe_intermediate_size

    @classmethod
    def decoder_options(cls, config) -> mixtral.MoeOptions:
        return cls.switches()

    @classmethod
    def build_mlp(cls, config, layer_idx: int, options=None):
        if layer_idx < config.first_k_dense_replace:
            return GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)
        return SharedExpertsMoe(config.hidden_size, num_experts=cls.num_experts(config),
                                top_k=config.num_experts_per_tok, intermediate_size=config.moe_intermediate_size,
                                act=config.hidden_act, n_group=config.n_group, topk_group=config.topk_group,
                                norm_topk_prob=config.norm_topk_prob,
                                routed_scaling_factor=config.routed_scaling_factor,
                                shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts)

    @classmethod
    def num_experts(cls, config) -> int:
        return config.n_routed_experts


class DeepseekV3Model(DeepseekV3PreTrainedModel, mixtral.MixtralModel):
    hf_twin = transformers.DeepseekV3Model


DeepseekV3PreTrainedModel.base_model_class = DeepseekV3Model


class DeepseekV3ForCausalLM(DeepseekV3PreTrainedModel, mixtral.MixtralForCausalLM):
    """``DeepseekV3ForCausalLM``: ``MixtralForCausalLM``'s forward with the causal-LM loss alone (no router loss,
    as ``transformers``: ``router_aux_loss``), router logits with ``output_router_logits`` (as routed: the grid is
    refused, ``moe_grid=False``). Pipeline stages: the shared stack's (``StackPipelineAdapter``)."""

    hf_twin = transformers.DeepseekV3ForCausalLM
    pipeline_adapter_class = StackPipelineAdapter
    router_aux_loss = False


class DeepseekV3ForSequenceClassification(DeepseekV3PreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin = transformers.DeepseekV3ForSequenceClassification


class DeepseekV3ForTokenClassification(DeepseekV3PreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin = transformers.DeepseekV3ForTokenClassification
