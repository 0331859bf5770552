"""T5's layers, single-device with ``transformers``' names: the attention (unscaled, with the learned relative
position bias of this rank's heads), the self-/cross-attention and feed-forward sub-layers (pre-norm residuals, fp16
clamping as ``transformers``) and ``T5Block``. The stacks and heads that use them: ``modeling_t5.py``.

Shapes: b batch, s sequence, d d_model, n heads (n/tp per rank), d_kv head dim.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.t5.modeling_t5 import T5Attention as _HFT5Attention
from transformers.models.t5.modeling_t5 import eager_attention_forward

from ...parallel_layers.context_parallel.gathered import gathered_attention
from ...parallel_layers.context_parallel.mask import ContextParallelMask
from ...parallel_layers.layers import Dropout, Embedding, Linear
from ..common import DenseActDense, DenseGatedActDense, RMSNorm, attend, split_heads
from ..common.attention.attention import AttentionModule
from ..common.rules.parallel_rules import Heads
from .parallel_plan import T5_ATTENTION_PLAN


class T5Attention(AttentionModule):
    """Self- or cross-attention on this rank's heads. Input ``[b, s(/tp), d]``; output ``[b, s(/tp), d]``
    (``o`` is row-parallel: all-reduce, or reduce-scatter under SP). Returns ``(output, position_bias, weights)``
    with ``position_bias [1, n/tp, s_q, s_k]`` for the next blocks to reuse and ``weights [b, n/tp, s_q, s_k]``
    (eager attention only, else ``None``).

    Under context parallelism (``mask`` a ``ContextParallelMask``: the self-attention of a cp stack) this rank's
    queries attend the gathered keys of the whole sequence (``context_parallel/gathered.py``: one all-gather of keys
    and of values), with the bias ``[1, n/tp, s_local, s]`` of its queries' global positions against every key's
    (``compute_bias(query_positions=...)``); the cross-attention reads the gathered encoder output with a plain
    mask and needs nothing else."""

    tp_plan = T5_ATTENTION_PLAN

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_heads", config.num_heads)]

    def __init__(self, config, has_relative_attention_bias: bool = False, layer_idx: int | None = None,
                 is_causal: bool = False):
        super().__init__()
        self.config = config
        self.is_decoder = config.is_decoder
        self.is_causal = is_causal
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.relative_attention_max_distance = config.relative_attention_max_distance
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.num_heads
        self.inner_dim = self.n_heads * self.key_value_proj_dim
        self.layer_idx = layer_idx
        self.q = Linear(config.d_model, self.inner_dim, bias=False)
        self.k = Linear(config.d_model, self.inner_dim, bias=False)
        self.v = Linear(config.d_model, self.inner_dim, bias=False)
        self.o = Linear(self.inner_dim, config.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = Embedding(self.relative_attention_num_buckets, self.n_heads)
        self.dropout = Dropout(config.dropout_rate)  # attention probabilities (a float in transformers: no keys)

    def compute_bias(self, query_length: int, key_length: int, device=None, past_seen_tokens=0,
                     query_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Bucketed relative position bias for this rank's heads: ``[1, n/tp, query_length, key_length]``;
        ``query_positions [query_length]``: the queries' positions (a cp rank's global ones), else ``past + arange``."""
        if query_positions is not None:
            context_position = query_positions.to(device=device, dtype=torch.long)[:, None]
        else:
            context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past_seen_tokens
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        buckets = _HFT5Attention._relative_position_bucket(
            memory_position - context_position, bidirectional=not self.is_decoder,
            num_buckets=self.relative_attention_num_buckets, max_distance=self.relative_attention_max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, past_key_values=None,
                **kwargs):
        past_seen = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
        is_cross_attention = key_value_states is not None
        query = split_heads(self.q(hidden_states), self.key_value_proj_dim)  # [b, n/tp, s, d_kv]

        cache, is_updated = past_key_values, False
        if isinstance(past_key_values, EncoderDecoderCache):
            is_updated = past_key_values.is_updated.get(self.layer_idx)
            cache = (past_key_values.cross_attention_cache if is_cross_attention
                     else past_key_values.self_attention_cache)
        if is_cross_attention and past_key_values is not None and is_updated:  # encoder k/v computed at step one
            key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        else:
            # cross-attention reads the encoder output, full and replicated: never sequence-parallel, also inside a
            # sequence-parallel decoder (the explicit override); self-attention follows the stack's region
            source, source_sp = (key_value_states, False) if is_cross_attention else (hidden_states, None)
            key = split_heads(self.k(source, sequence_parallel=source_sp), self.key_value_proj_dim)
            value = split_heads(self.v(source, sequence_parallel=source_sp), self.key_value_proj_dim)
            if past_key_values is not None:
                key, value = cache.update(key, value, self.layer_idx)
                if is_cross_attention and isinstance(past_key_values, EncoderDecoderCache):
                    past_key_values.is_updated[self.layer_idx] = True

        cp_mask = mask if isinstance(mask, ContextParallelMask) else None
        if position_bias is None:
            query_length, key_length = query.shape[2], key.shape[2]  # full lengths, also under SP
            if cp_mask is not None:  # this rank's queries against the whole sequence's keys
                key_length *= cp_mask.size
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(query_length, key_length, query.device, past_seen,
                                                  None if cp_mask is None else cp_mask.token_index[cp_mask.rank])
            else:
                position_bias = torch.zeros((1, query.shape[1], query_length, key_length), device=query.device,
                                            dtype=query.dtype)
        if cp_mask is not None:
            out = gathered_attention(query, key, value, cp_mask, bias=position_bias, scaling=1.0,
                                     dropout=self.dropout)
            return self.o(out.reshape(*out.shape[:-2], -1)), position_bias, None
        out, weights = attend(self, query, key, value, mask, dropout=self.dropout, scaling=1.0,
                              eager_fallback=eager_attention_forward, position_bias=position_bias, **kwargs)
        return self.o(out), position_bias, weights


class T5LayerSelfAttention(nn.Module):
    """``(x + dropout(SelfAttention(layer_norm(x))), position_bias, weights)``, as ``transformers`` (the output
    recorder reads the weights, index -1)."""

    def __init__(self, config, has_relative_attention_bias=False, layer_idx=None):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias, layer_idx, is_causal=config.is_decoder)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, past_key_values=None, **kwargs):
        out, position_bias, weights = self.SelfAttention(self.layer_norm(hidden_states), mask=attention_mask,
                                                         position_bias=position_bias,
                                                         past_key_values=past_key_values, **kwargs)
        return hidden_states + self.dropout(out), position_bias, weights


class T5LayerCrossAttention(nn.Module):
    """``(x + dropout(EncDecAttention(layer_norm(x), encoder output)), position_bias, weights)``."""

    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=False, layer_idx=layer_idx)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden_states, key_value_states, attention_mask=None, position_bias=None,
                past_key_values=None, **kwargs):
        out, position_bias, weights = self.EncDecAttention(self.layer_norm(hidden_states), mask=attention_mask,
                                                           key_value_states=key_value_states,
                                                           position_bias=position_bias,
                                                           past_key_values=past_key_values, **kwargs)
        return hidden_states + self.dropout(out), position_bias, weights


class T5LayerFF(nn.Module):
    def __init__(self, config):
        super().__init__()
        mlp = DenseGatedActDense if config.is_gated_act else DenseActDense
        self.DenseReluDense = mlp(config.d_model, config.d_ff, act=config.dense_act_fn, dropout=config.dropout_rate)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


def _clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' guard against fp16 overflow in T5 activations (a no-op in other dtypes)."""
    if hidden_states.dtype != torch.float16:
        return hidden_states
    finfo = torch.finfo(hidden_states.dtype)
    clamp_value = torch.where(torch.isinf(hidden_states).any(), finfo.max - 1000, finfo.max)
    return torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)


class T5Block(GradientCheckpointingLayer):
    """Self-attention, cross-attention (decoder), feed-forward (``build_feed_forward``: the hook Switch
    Transformers overrides with its sparse layers; ``feed_forward_kwargs`` reach only that sub-layer). Returns
    ``(hidden_states, position_bias, encoder_decoder_position_bias)``."""

    def __init__(self, config, has_relative_attention_bias=False, layer_idx=None):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.layer = nn.ModuleList([T5LayerSelfAttention(config, has_relative_attention_bias, layer_idx)])
        if self.is_decoder:
            self.layer.append(T5LayerCrossAttention(config, layer_idx=layer_idx))
        self.layer.append(self.build_feed_forward(config, layer_idx))

    def build_feed_forward(self, config, layer_idx) -> nn.Module:
        return T5LayerFF(config)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None, past_key_values=None, *,
                feed_forward_kwargs: dict | None = None, **kwargs):
        hidden_states, position_bias, _ = self.layer[0](hidden_states, attention_mask, position_bias,
                                                        past_key_values, **kwargs)
        hidden_states = _clamp_fp16(hidden_states)
        if self.is_decoder and encoder_hidden_states is not None:
            hidden_states, encoder_decoder_position_bias, _ = self.layer[1](
                hidden_states, encoder_hidden_states, encoder_attention_mask, encoder_decoder_position_bias,
                past_key_values, **kwargs)
            hidden_states = _clamp_fp16(hidden_states)
        hidden_states = self.layer[-1](hidden_states, **(feed_forward_kwargs or {}))
        hidden_states = _clamp_fp16(hidden_states)
        return hidden_states, position_bias, encoder_decoder_position_bias
