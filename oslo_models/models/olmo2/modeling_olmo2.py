"""OLMo 2: the Llama decoder (``models/llama``) with post-norms only and full-width q/k norms, declared from a config
class and a ``StackSpec`` (``declare_stack_family``).

What differs from Llama, and where:

- no pre-norms: ``x + post_attention_layernorm(self_attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``
  (``Olmo2DecoderLayer``: the sandwich layer with only its post norms);
- RMS norms of the ``"olmo2"`` formula (normalize and scale in fp32, then round; the final norm too);
- ``q_norm``/``k_norm`` over the whole ``q_proj``/``k_proj`` output (``n*d`` / ``n_kv*d`` wide), before the head
  split: ``FullWidthQKNormAttention``. Under tensor parallelism each rank holds its heads' slice of the norm weight
  and the sum of squares is all-reduced over TP (``common/full_width_norm.py``: one all-reduce of ``[b, s, 1]``
  per norm forward and backward). This is also why the config keeps ``transformers``' own ``base_model_tp_plan``
  (which gathers q/k/v): ``transformers``' plan vocabulary has no norm across ranks.
"""
from __future__ import annotations

import dataclasses

import transformers

from ..common import FullWidthQKNormAttention, GatedMLP, RMSNorm
from ..declare import declare_stack_family
from ..llama import modeling_llama as llama
from .configuration_olmo2 import Olmo2Config


class Olmo2DecoderLayer(llama.SandwichDecoderLayer):
    names = dict(attn="self_attn", post_attn_norm="post_attention_layernorm", mlp="mlp",
                 post_mlp_norm="post_feedforward_layernorm")


OLMO2_SPEC = dataclasses.replace(
    llama.LLAMA_SPEC, block=Olmo2DecoderLayer, norm=RMSNorm,
    components=dict(attn=FullWidthQKNormAttention, mlp=GatedMLP, post_attn_norm=RMSNorm, post_mlp_norm=RMSNorm))


def _decoder_options(cls, config) -> dict:
    bias = bool(config.attention_bias)
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, attention=FullWidthQKNormAttention,
                norm_formula="olmo2")


globals().update(declare_stack_family(
    "Olmo2", Olmo2Config, OLMO2_SPEC, like=llama.LlamaPreTrainedModel, module=__name__,
    hf_twins={"base": transformers.Olmo2Model, "causal_lm": transformers.Olmo2ForCausalLM,
              "sequence_classification": transformers.Olmo2ForSequenceClassification},
    decoder_options=classmethod(_decoder_options), decoder_layer_class=Olmo2DecoderLayer,
    _no_split_modules=["Olmo2DecoderLayer"],
    _can_record_outputs={"hidden_states": Olmo2DecoderLayer, "attentions": FullWidthQKNormAttention}))
