"""Gemma 2: Gemma (``models/gemma``) with sandwich norms, soft-capping, query scaling and alternating windows.

What differs from Gemma 1, and where:

- sandwich norms: ``x + post_attention_layernorm(self_attn(input_layernorm(x)))``, then ``x +
  post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (``Gemma2DecoderLayer``, the Llama family's
  ``SandwichDecoderLayer`` under Gemma 2's names), all ``(1 + w)`` norms;
- attention logits soft-capped, ``c * tanh(scores / c)`` before the mask (``attn_logit_softcapping``), and scaled
  by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``: ``GroupedQueryAttention``'s ``softcap`` and
  ``scaling`` (``decoder_options``). The cap acts per head, so tensor parallelism needs nothing more; the
  context-parallel cores (ring / all-to-all) cap the scores inside each block before their log-sum-exp merge.
  SDPA cannot cap: the default kernel is eager, as
  ``transformers`` makes it for Gemma 2 (``_supports_sdpa = False``); flash / flex take ``softcap`` themselves;
- the final logits soft-capped, ``c * tanh(logits / c)`` (``final_logit_softcapping``), before the loss: the
  generic causal LM head reads it from the config (``ForCausalLM.final_logit_softcap``), also on the vocab-split
  logits (padding columns stay ``-inf``), on the pipeline's last stage and with ``skip_logits`` (which then runs the
  loss on materialized local logits: the fused loss-only kernel has no cap);
- sliding-window and full attention alternating (``layer_types``, default: even layers slide) with
  ``sliding_window``: the stack's per-type masks, as for Mistral / Qwen2;
- the MLP activation is ``hidden_activation``.
"""
from __future__ import annotations

import dataclasses

import transformers

from ..common import GatedMLP, GroupedQueryAttention, RMSNorm
from ..gemma import modeling_gemma as gemma
from ..gemma.configuration_gemma import Gemma2Config
from ..llama import modeling_llama as llama


class Gemma2DecoderLayer(llama.SandwichDecoderLayer):
    names = dict(attn_norm="input_layernorm", attn="self_attn", post_attn_norm="post_attention_layernorm",
                 mlp_norm="pre_feedforward_layernorm", mlp="mlp", post_mlp_norm="post_feedforward_layernorm")


GEMMA2_SPEC = dataclasses.replace(
    llama.LLAMA_SPEC, block=Gemma2DecoderLayer,
    components=dict(attn=GroupedQueryAttention, mlp=GatedMLP, attn_norm=RMSNorm, post_attn_norm=RMSNorm,
                    mlp_norm=RMSNorm, post_mlp_norm=RMSNorm),
    # SDPA cannot soft-cap the attention logits (transformers' Gemma 2 says the same)
    kernels=GroupedQueryAttention.kernels - {"sdpa"})


class Gemma2PreTrainedModel(gemma.GemmaPreTrainedModel):
    config_class = Gemma2Config
    stack_spec = GEMMA2_SPEC
    activation_attr = "hidden_activation"

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return dataclasses.replace(super().decoder_options(config), scaling=config.query_pre_attn_scalar ** -0.5,
                                   softcap=config.attn_logit_softcapping)


class Gemma2Model(Gemma2PreTrainedModel, gemma.GemmaModel):
    hf_twin = transformers.Gemma2Model


Gemma2PreTrainedModel.base_model_class = Gemma2Model


class Gemma2ForCausalLM(Gemma2PreTrainedModel, gemma.GemmaForCausalLM):
    hf_twin, base_model_class = transformers.Gemma2ForCausalLM, Gemma2Model


class Gemma2ForSequenceClassification(Gemma2PreTrainedModel, gemma.GemmaForSequenceClassification):
    hf_twin, base_model_class = transformers.Gemma2ForSequenceClassification, Gemma2Model


class Gemma2ForTokenClassification(Gemma2PreTrainedModel, gemma.GemmaForTokenClassification):
    hf_twin, base_model_class = transformers.Gemma2ForTokenClassification, Gemma2Model
