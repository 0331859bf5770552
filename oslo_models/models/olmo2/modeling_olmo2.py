"""OLMo 2: the Llama decoder (``models/llama``) with post-norms only and full-width q/k norms: its spec and its
switches; the classes are one line each, as ``transformers``' generated files write them.

What differs from Llama, and where:

- no pre-norms: ``x + post_attention_layernorm(self_attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``
  (``Olmo2DecoderLayer``: the sandwich layer with only its post norms);
- RMS norms of the ``"olmo2"`` formula (normalize and scale in fp32, then round; the final norm too);
- ``q_norm``/``k_norm`` over the whole ``q_proj``/``k_proj`` output (``n*d`` / ``n_kv*d`` wide), before the head
  split: ``FullWidthQKNormAttention``. Under tensor parallelism each rank holds its heads' slice of the norm weight
  and the sum of squares is all-reduced over TP (``common/norms/full_width_norm.py``: one all-reduce of ``[b, s, 1]``
  per norm forward and backward). This is also why the config keeps ``transformers``' own ``base_model_tp_plan``
  (which gathers q/k/v): ``transformers``' plan vocabulary has no norm across ranks.
"""
from __future__ import annotations

import dataclasses

import transformers

from ..common import FullWidthQKNormAttention, GatedMLP, RMSNorm
from ..llama import modeling_llama as llama
from .configuration_olmo2 import Olmo2Config


class Olmo2DecoderLayer(llama.SandwichDecoderLayer):
    names = dict(attn="self_attn", post_attn_norm="post_attention_layernorm", mlp="mlp",
                 post_mlp_norm="post_feedforward_layernorm")


OLMO2_SPEC = dataclasses.replace(
    llama.LLAMA_SPEC, block=Olmo2DecoderLayer, norm=RMSNorm,
    components=dict(attn=FullWidthQKNormAttention, mlp=GatedMLP, post_attn_norm=RMSNorm, post_mlp_norm=RMSNorm))


class Olmo2PreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = Olmo2Config
    stack_spec = OLMO2_SPEC

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return cls.biased_switches(config, norm_formula="olmo2")


class Olmo2Model(Olmo2PreTrainedModel, llama.LlamaModel):
    hf_twin = transformers.Olmo2Model


Olmo2PreTrainedModel.base_model_class = Olmo2Model


class Olmo2ForCausalLM(Olmo2PreTrainedModel, llama.LlamaForCausalLM):
    hf_twin = transformers.Olmo2ForCausalLM
    pipeline_grid_modes = False  # its pipeline stages are not tested on the 2D / 2.5D / 3D grid: refused there


class Olmo2ForSequenceClassification(Olmo2PreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin = transformers.Olmo2ForSequenceClassification
