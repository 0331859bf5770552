"""Qwen3-MoE: the Mixtral / Qwen2-MoE code (``models/mixtral``, ``models/qwen2_moe``) with Qwen3-MoE's switches:

- q/k RMS norms over ``head_dim`` before rotary (``GroupedQueryAttention(qk_norm=True)``, as Qwen3), biases on
  q/k/v/o with ``attention_bias``;
- top-k renormalization only with ``norm_topk_prob``; routing weights cast to the logits' dtype;
- sparse blocks where ``decoder_sparse_step`` / ``mlp_only_layers`` say so, dense SwiGLU MLPs
  (``intermediate_size``) in the other layers; no shared expert;
- router logits and the load-balancing loss (``output_router_logits``, ``router_aux_loss_coef``) as
  ``transformers`` computes them (``MixtralForCausalLM``'s forward; pipeline stages carry its statistics);
- checkpoints in the per-expert Hub layout ``mlp.experts.N.gate_proj/up_proj/down_proj`` (``transformers``'
  Qwen2-MoE conversion mapping, which it uses for this type too).

Expert parallelism splits each sparse layer's experts over ``expert_parallel_size`` (all-to-all dispatch and
combine); tensor parallelism splits attention and the dense MLPs as in Llama, experts over
``expert_tensor_parallel_size`` ranks; sequence, pipeline and context parallelism as Mixtral.
"""
from __future__ import annotations

import transformers

from ..llama import modeling_llama as llama
from ..mixtral import modeling_mixtral as mixtral
from ..qwen2_moe.modeling_qwen2_moe import Qwen2MoePreTrainedModel
from .configuration_qwen3_moe import Qwen3MoeConfig


class Qwen3MoePreTrainedModel(Qwen2MoePreTrainedModel):
    config_class = Qwen3MoeConfig

    @classmethod
    def decoder_options(cls, config) -> mixtral.MoeOptions:
        moe = mixtral.moe_switches(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                                   intermediate_size=config.moe_intermediate_size, act=config.hidden_act,
                                   normalize=config.norm_topk_prob, weights_in_logits_dtype=True)
        return cls.biased_switches(config, qk_norm=True, moe=moe, sparse_layers=cls.sparse_layers(config),
                                   dense_intermediate_size=config.intermediate_size)


class Qwen3MoeModel(Qwen3MoePreTrainedModel, mixtral.MixtralModel):
    hf_twin = transformers.Qwen3MoeModel


Qwen3MoePreTrainedModel.base_model_class = Qwen3MoeModel


class Qwen3MoeForCausalLM(Qwen3MoePreTrainedModel, mixtral.MixtralForCausalLM):
    hf_twin = transformers.Qwen3MoeForCausalLM


class Qwen3MoeForSequenceClassification(Qwen3MoePreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin = transformers.Qwen3MoeForSequenceClassification


class Qwen3MoeForTokenClassification(Qwen3MoePreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin = transformers.Qwen3MoeForTokenClassification


class Qwen3MoeForQuestionAnswering(Qwen3MoePreTrainedModel, llama.LlamaForQuestionAnswering):
    hf_twin = transformers.Qwen3MoeForQuestionAnswering
    base_model_prefix = "transformer"  # transformers' backward-compatible name for this head
