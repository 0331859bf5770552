"""StarCoder2: a pre-norm decoder on the shared stack, made of shared components:

- ``LayerNorm`` with biases (``norm_epsilon``) before attention and MLP, and as the final norm;
- grouped-query attention with biases on q/k/v/o (``use_bias``) and rotary positions (``GroupedQueryAttention``),
  sliding-window in every layer when ``sliding_window`` is set (``transformers``' StarCoder2 rule);
- a two-layer MLP ``c_proj(act(c_fc(x)))`` with biases (``use_bias``) and its residual dropout (``DenseMLP``);
- ``residual_dropout`` on the attention output (``ResidualDropout``, ``attn_residual_dropout``: ``transformers``
  drops functionally inside the attention, a module here so the plan can give it its tensor-parallel stream) and
  ``embedding_dropout`` on the token embeddings (the stack's embedding-dropout phase).

Under tensor parallelism: q column-parallel, k/v key/value-head-parallel (replicated when ``tp > n_kv``), o and
``c_proj`` row-parallel, ``c_fc`` column-parallel, the norms sequence-parallel aware, the dropouts on the residual
stream drawing per-rank masks only under sequence parallelism.

Shapes: b batch, s sequence, h hidden.
"""
from __future__ import annotations

import transformers
from torch import nn

from ..common import DenseMLP, GroupedQueryAttention, LayerNorm, RotaryEmbedding
from ..common.attention.causal_masks import every_layer_slides
from ..common.stack.blocks import PreNormBlock, ResidualDropout
from ..common.stack.stack import StackSpec
from ..common.stack.stack_parts import EmbeddingDropout, FinalNorm, Layers, Rotary, TokenEmbedding, layer_norm
from ..llama import modeling_llama as llama
from .configuration_starcoder2 import Starcoder2Config


class Starcoder2MLP(DenseMLP):
    names = ("c_fc", "c_proj")


class Starcoder2DecoderLayer(PreNormBlock):
    """``x + attn_residual_dropout(self_attn(input_layernorm(x)))``, then ``x + mlp(post_attention_layernorm(x))``
    (the MLP drops its own output)."""

    names = dict(attn_norm="input_layernorm", attn="self_attn", mlp_norm="post_attention_layernorm", mlp="mlp",
                 attn_dropout="attn_residual_dropout")

    def __init__(self, config, layer_idx: int, *, options: llama.DecoderOptions, attention_type: str,
                 mlp: nn.Module):
        attention = llama.decoder_attention(config, layer_idx, options, attention_type)
        super().__init__(attn=attention, mlp=mlp, attn_norm=LayerNorm(config.hidden_size, eps=config.norm_epsilon),
                         mlp_norm=LayerNorm(config.hidden_size, eps=config.norm_epsilon),
                         attn_dropout=ResidualDropout(config.residual_dropout),
                         order=("attn", "mlp", "attn_norm", "mlp_norm", "attn_dropout"))
        self.attention_type = attention_type


STARCODER2_SPEC = StackSpec(block=Starcoder2DecoderLayer,
                            components=dict(attn=GroupedQueryAttention, mlp=Starcoder2MLP, attn_norm=LayerNorm,
                                            mlp_norm=LayerNorm, attn_dropout=ResidualDropout),
                            parts=(TokenEmbedding("embed_tokens"), Layers("layers"),
                                   FinalNorm("norm", layer_norm("norm_epsilon")), Rotary("rotary_emb", RotaryEmbedding),
                                   EmbeddingDropout("embedding_dropout", "embedding_dropout")))


class Starcoder2PreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = Starcoder2Config
    config: Starcoder2Config
    stack_spec = STARCODER2_SPEC

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return cls.switches(qkv_bias=config.use_bias, o_bias=config.use_bias, mlp_bias=config.use_bias)

    @classmethod
    def build_mlp(cls, config, layer_idx: int, options=None) -> nn.Module:
        return Starcoder2MLP(config.hidden_size, config.intermediate_size, act=config.hidden_act,
                             bias=config.use_bias, dropout=config.residual_dropout)

    #: every layer slides when ``sliding_window`` is set (``Starcoder2Model`` picks one mask for all)
    attention_types = staticmethod(every_layer_slides)


class Starcoder2Model(Starcoder2PreTrainedModel, llama.LlamaModel):
    """Built from ``STARCODER2_SPEC``'s parts: embeddings (with ``embedding_dropout``), the decoder layers, the final
    ``LayerNorm`` and the rotary embedding; the forward is the shared stack's. Output ``last_hidden_state``:
    ``[b, s, h]``."""

    hf_twin = transformers.Starcoder2Model


Starcoder2PreTrainedModel.base_model_class = Starcoder2Model


class Starcoder2ForCausalLM(Starcoder2PreTrainedModel, llama.LlamaForCausalLM):
    hf_twin = transformers.Starcoder2ForCausalLM


class Starcoder2ForSequenceClassification(Starcoder2PreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin = transformers.Starcoder2ForSequenceClassification


class Starcoder2ForTokenClassification(Starcoder2PreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin = transformers.Starcoder2ForTokenClassification
