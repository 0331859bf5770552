"""BERT's attention cores, single-device with ``transformers``' names: ``query``/``key``/``value`` (column-parallel
under tensor parallelism: rank r owns heads ``r*n/tp .. (r+1)*n/tp``) and the probability dropout, for the
self-attention and, in a decoder with ``config.add_cross_attention``, the cross-attention over the encoder output.
The sub-layers around them (output projection, residual, LayerNorm): ``modeling_bert.py``.

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim.
"""
from __future__ import annotations

from transformers.models.bert.modeling_bert import eager_attention_forward

from ...parallel_layers.layers import Dropout, Linear
from ..common import attend, split_heads
from ..common.attention.attention import AttentionModule
from ..common.attention.cross_attention import cached_keys_values


class _BertAttentionCore(AttentionModule):
    """``query``/``key``/``value`` (column-parallel: this rank's ``n/tp`` heads) and the probability dropout, shared
    by the self- and the cross-attention (``transformers``' ``BertSelfAttention`` / ``BertCrossAttention``, one key
    layout)."""

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size ** -0.5
        self.is_causal = False
        self.query = Linear(config.hidden_size, self.all_head_size)
        self.key = Linear(config.hidden_size, self.all_head_size)
        self.value = Linear(config.hidden_size, self.all_head_size)
        self.dropout = Dropout(config.attention_probs_dropout_prob)

    def attention(self, hidden_states, source, attention_mask, past_key_values, *, cross: bool, **kwargs):
        """Queries from ``hidden_states``, keys/values from ``source`` (cached:
        ``common/attention/cross_attention.py``)."""
        query = split_heads(self.query(hidden_states), self.attention_head_size)  # [b, n/tp, s, d]
        # the encoder output is full and replicated: never sequence-parallel (an explicit override)
        source_sp = False if cross else None

        def project():
            return tuple(split_heads(proj(source, sequence_parallel=source_sp), self.attention_head_size)
                         for proj in (self.key, self.value))

        key, value = cached_keys_values(past_key_values, self.layer_idx, cross=cross, project=project)
        return attend(self, query, key, value, attention_mask, dropout=self.dropout, scaling=self.scaling,
                      eager_fallback=eager_attention_forward, **kwargs)


class BertSelfAttention(_BertAttentionCore):
    """Attention on this rank's heads: input ``[b, s(/tp), h]``, output ``([b, s, (n/tp)*d], weights)``.
    Bidirectional, or causal with a key/value cache when ``config.is_decoder`` (``BertLMHeadModel``,
    ``RobertaForCausalLM``; an ``EncoderDecoderCache``'s self part under cross-attention)."""

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__(config, layer_idx)
        self.is_causal = bool(config.is_decoder)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        return self.attention(hidden_states, hidden_states, attention_mask, past_key_values, cross=False, **kwargs)


class BertCrossAttention(_BertAttentionCore):
    """A decoder layer's attention over ``encoder_hidden_states [b, s_enc, h]`` (full, replicated over TP), queries
    ``[b, s(/tp), h]`` on this rank's heads; its keys/values are cached once per generation
    (``EncoderDecoderCache``, ``common/attention/cross_attention.py``). Output ``([b, s, (n/tp)*d], weights)``."""

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, past_key_values=None,
                **kwargs):
        return self.attention(hidden_states, encoder_hidden_states, attention_mask, past_key_values, cross=True,
                              **kwargs)
