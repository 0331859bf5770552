"""BART's layers, single-device with ``transformers``' names: the attention (self- or cross-, ``q_proj/k_proj/
v_proj/out_proj`` with biases), the feed-forward's plan (``fc1``/``fc2`` live on the layer, as in ``transformers``)
and the two post-norm layers. The stacks and models that run them: ``modeling_bart.py``.

Layers (every residual branch ends in ``dropout``, then add and LayerNorm):

- ``BartEncoderLayer``: the post-norm template (``PostNormBlock``): ``x = self_attn_layer_norm(x + attn(x))``,
  ``x = final_layer_norm(x + fc2(activation_dropout(act(fc1(x)))))``;
- ``BartDecoderLayer``: the same with the cross-attention sub-layer between them:
  ``x = encoder_attn_layer_norm(x + encoder_attn(x, encoder output))``.

Tensor parallelism: ``q/k/v_proj`` column-parallel (rank r owns heads ``r*n/tp .. (r+1)*n/tp``, also in the
cross-attention), ``out_proj`` row-parallel (all-reduce; reduce-scatter under sequence parallelism), ``fc1``
column-, ``fc2`` row-parallel; the LayerNorms see ``[b, s/tp, d]`` under sequence parallelism (their gradients are
summed over TP by their style). The cross-attention's k/v read the encoder output, full and replicated: see
``common/attention/cross_attention.py``.

Shapes: b batch, s sequence (s/tp between the layers' sub-blocks under SP), d d_model, n heads (n/tp per rank).
"""
from __future__ import annotations

import torch
from transformers.activations import ACT2FN
from transformers.models.bart.modeling_bart import eager_attention_forward

from ...parallel_layers.layers import Dropout, Linear
from ...parallel_layers.plan import Colwise, Rowwise, TPDropout
from ..common.attention.attention import AttentionModule, attend, split_heads
from ..common.attention.cross_attention import cached_keys_values
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.parallel_rules import Features, Heads
from ..common.stack.blocks import PostNormBlock


class BartAttention(AttentionModule):
    """Self-attention (``key_value_states=None``) or cross-attention over ``key_value_states [b, s_enc, d]`` on this
    rank's heads, scaled by ``head_dim ** -0.5`` inside the kernel (``transformers``' order). Input
    ``[b, s(/tp), d]``; returns ``(output [b, s(/tp), d], weights [b, n/tp, s_q, s_k] or None)``."""

    tp_plan = {"q_proj": Colwise(), "k_proj": Colwise(), "v_proj": Colwise(), "out_proj": Rowwise(),
               "attn_dropout": TPDropout(always_split=True)}  # the probabilities of this rank's heads

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("encoder_attention_heads", config.encoder_attention_heads),
                Heads("decoder_attention_heads", config.decoder_attention_heads)]

    def __init__(self, config, num_heads: int, *, is_causal: bool = False, layer_idx: int | None = None):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, is_causal
        self.embed_dim, self.num_heads = config.d_model, num_heads
        self.head_dim = self.embed_dim // num_heads
        if self.head_dim * num_heads != self.embed_dim:
            raise ValueError(f"embed_dim must be divisible by num_heads (got `embed_dim`: {self.embed_dim} and "
                             f"`num_heads`: {num_heads}).")
        self.scaling = self.head_dim ** -0.5
        self.k_proj = Linear(self.embed_dim, self.embed_dim)  # transformers' registration order
        self.v_proj = Linear(self.embed_dim, self.embed_dim)
        self.q_proj = Linear(self.embed_dim, self.embed_dim)
        self.out_proj = Linear(self.embed_dim, self.embed_dim)
        self.attn_dropout = Dropout(config.attention_dropout)  # a float in transformers: no keys

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                key_value_states=None, **kwargs):
        cross = key_value_states is not None
        query = split_heads(self.q_proj(hidden_states), self.head_dim)  # [b, n/tp, s, d_head]
        # the encoder output is full and replicated: never sequence-parallel (common/attention/cross_attention.py)
        source, source_sp = (key_value_states, False) if cross else (hidden_states, None)

        def project():
            return (split_heads(self.k_proj(source, sequence_parallel=source_sp), self.head_dim),
                    split_heads(self.v_proj(source, sequence_parallel=source_sp), self.head_dim))

        key, value = cached_keys_values(past_key_values, self.layer_idx, cross=cross, project=project)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attn_dropout,
                              scaling=self.scaling, eager_fallback=eager_attention_forward, **kwargs)
        return self.out_proj(out), weights


class BartFeedForward:
    """The plan and rules of the feed-forward ``fc2(activation_dropout(act(fc1(x))))`` and the layer's residual
    ``dropout``, which ``transformers`` keeps on the layer itself (the block role named ``""``)."""

    tp_plan = {"fc1": Colwise(), "fc2": Rowwise(), "dropout": TPDropout(),
               "activation_dropout": TPDropout(always_split=True)}  # on [b, s, ffn/tp]: this rank's columns

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("encoder_ffn_dim", config.encoder_ffn_dim),
                Features("decoder_ffn_dim", config.decoder_ffn_dim)]


class _BartLayer(PostNormBlock):
    """What both layers share: ``fc1``/``fc2``/``final_layer_norm`` registered after the attention sub-layers (as
    ``transformers``), the residual ``dropout`` at the end of each branch, fp16 clamping as ``transformers``."""

    names = dict(attn="self_attn", attn_norm="self_attn_layer_norm", mlp="", mlp_norm="final_layer_norm")
    optional_roles = ("mlp",)

    def _build_feed_forward(self, config, ffn_dim: int, final_norm: LayerNorm) -> None:
        self.fc1 = Linear(config.d_model, ffn_dim)
        self.fc2 = Linear(ffn_dim, config.d_model)
        self.final_layer_norm = final_norm
        self.dropout = Dropout(config.dropout)
        self.activation_dropout = Dropout(config.activation_dropout)
        self.activation_fn = ACT2FN[config.activation_function]

    def attend(self, x, attention_mask, position_embeddings, past_key_values, **kwargs) -> torch.Tensor:
        return self.dropout(super().attend(x, attention_mask, position_embeddings, past_key_values, **kwargs))

    def mlp_forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        inner = self.activation_dropout(self.activation_fn(self.fc1(x)))  # [b, s, ffn/tp]
        return self.dropout(self.fc2(inner))


def _clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype == torch.float16 and not torch.isfinite(hidden_states).all():
        clamp_value = torch.finfo(hidden_states.dtype).max - 1000
        return torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)
    return hidden_states


class BartEncoderLayer(_BartLayer):
    """``self_attn``, ``self_attn_layer_norm``, ``fc1``, ``fc2``, ``final_layer_norm``: the post-norm template."""

    def __init__(self, config, layer_idx: int | None = None):
        final_norm = LayerNorm(config.d_model)
        super().__init__(attn=BartAttention(config, config.encoder_attention_heads, layer_idx=layer_idx),
                         attn_norm=LayerNorm(config.d_model), mlp_norm=final_norm, order=("attn", "attn_norm"))
        self._build_feed_forward(config, config.encoder_ffn_dim, final_norm)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        return _clamp_fp16(super().forward(hidden_states, attention_mask, position_embeddings, None, **kwargs))


class BartDecoderLayer(_BartLayer):
    """``self_attn`` (causal, cached), ``self_attn_layer_norm``, ``encoder_attn`` (over the encoder output, its
    keys cached once), ``encoder_attn_layer_norm``, ``fc1``, ``fc2``, ``final_layer_norm``. The cross-attention
    runs when ``encoder_hidden_states`` are given (``BartForCausalLM`` may have none), as ``transformers``."""

    roles = ("attn", "attn_norm", "cross_attn", "cross_attn_norm", "mlp", "mlp_norm")
    names = dict(_BartLayer.names, cross_attn="encoder_attn", cross_attn_norm="encoder_attn_layer_norm")

    def __init__(self, config, layer_idx: int | None = None):
        heads = config.decoder_attention_heads
        final_norm = LayerNorm(config.d_model)
        super().__init__(attn=BartAttention(config, heads, is_causal=True, layer_idx=layer_idx),
                         attn_norm=LayerNorm(config.d_model),
                         cross_attn=BartAttention(config, heads, layer_idx=layer_idx),
                         cross_attn_norm=LayerNorm(config.d_model), mlp_norm=final_norm,
                         order=("attn", "attn_norm", "cross_attn", "cross_attn_norm"))
        self._build_feed_forward(config, config.decoder_ffn_dim, final_norm)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, *,
                encoder_hidden_states=None, encoder_attention_mask=None, **kwargs):
        hidden_states = self.self_attn_layer_norm(
            hidden_states + self.attend(hidden_states, attention_mask, None, past_key_values, **kwargs))
        if encoder_hidden_states is not None:
            out, _ = self.encoder_attn(hidden_states, attention_mask=encoder_attention_mask,
                                       past_key_values=past_key_values, key_value_states=encoder_hidden_states,
                                       **kwargs)
            hidden_states = self.encoder_attn_layer_norm(hidden_states + self.dropout(out))
        return self.final_layer_norm(hidden_states + self.mlp_forward(hidden_states))
