"""Self-attention whose q|k|v come from one linear packed *per head*: GPT-NeoX's ``query_key_value`` (and Bloom's).

The packed projection ``[3h, h]`` (``nn.Linear`` layout) orders its output rows ``[n, 3, d]``: head ``i`` owns
rows ``3d*i .. 3d*(i+1)``, its query, key and value one after the other. (GPT-2's ``c_attn`` packs the other way,
``[3, n, d]``: all queries, then all keys, then all values, so it needs ``PackedSplit``.) Because every head's
q|k|v are contiguous, the plain column split (``Colwise()``, ``EvenSplit`` of the rows) cuts whole heads with their
q, k and v: rank ``r`` holds heads ``r*n/tp .. (r+1)*n/tp`` (``n % tp == 0``, the ``Heads`` rule), and its local
output ``[b, s, (n/tp)*3d]`` unpacks locally with no communication. Cutting it as three packed blocks (GPT-2's
``Colwise(num_packed=3)``) would mix heads: ``tests/models/test_decoder_families_neox.py`` checks that it fails.

The output projection (``dense``) is row-parallel: its all-reduce (or reduce-scatter under sequence parallelism)
is the only forward collective. Attention runs through ``attend`` (SDPA by default, the family's eager kernel for
``"eager"``, the context-parallel core under a ``ContextParallelMask``). Rotary (full or partial: the first
``cos.shape[-1]`` dims of each head, ``apply_partial_rotary``) when the stack passes ``position_embeddings``.

Shapes: input ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism), output the same; inside, ``[b, n/tp, s,
d]`` per tensor.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from transformers.models.gpt_neox.modeling_gpt_neox import eager_attention_forward as neox_eager_attention

from ....parallel_layers.layers import Dropout, Linear
from ....parallel_layers.plan import Colwise, Rowwise, TPDropout
from ..embeddings.rotary import apply_partial_rotary
from ..rules.parallel_rules import Heads
from ..stack.fused_kernels import FusedKernels
from .attention import AttentionModule, attend


class HeadPackedAttention(FusedKernels, AttentionModule):
    """``query_key_value`` packed per head (``[n, 3, d]`` rows) and ``dense``, with biases when ``bias`` (GPT-NeoX's
    ``attention_bias``); ``attention_dropout`` on the probabilities (drawn from the tensor-parallel RNG stream: each
    rank drops elements of its own heads). ``fused``: the Triton rotary kernel where its layout matches."""

    qkv_name: ClassVar[str] = "query_key_value"
    out_name: ClassVar[str] = "dense"
    tp_plan = {"query_key_value": Colwise(), "dense": Rowwise(), "attn_dropout": TPDropout(always_split=True)}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config, layer_idx: int, *, bias: bool = True, attention_dropout: float = 0.0,
                 eager_fallback=None):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"hidden_size={config.hidden_size} is not divisible by num_attention_heads="
                             f"{config.num_attention_heads}")
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.add_module(self.qkv_name, Linear(config.hidden_size, 3 * config.hidden_size, bias=bias))
        self.add_module(self.out_name, Linear(config.hidden_size, config.hidden_size, bias=bias))
        self.attn_dropout = Dropout(attention_dropout)
        self._eager_fallback = eager_fallback or neox_eager_attention

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query``, ``key``, ``value``, each ``[b, n/tp, s, d]``: this rank's whole heads."""
        qkv = getattr(self, self.qkv_name)(hidden_states)  # [b, s, (n/tp)*3d], head-major
        qkv = qkv.view(*qkv.shape[:-1], -1, 3 * self.head_dim).transpose(1, 2)  # [b, n/tp, s, 3d]
        query, key, value = qkv.chunk(3, dim=-1)
        return query, key, value

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        query, key, value = self.project(hidden_states)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query, key = apply_partial_rotary(query, key, cos, sin, fused=self.fused)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attn_dropout,  # [b, s, h/tp]
                              scaling=self.scaling, eager_fallback=self._eager_fallback, **kwargs)
        return getattr(self, self.out_name)(out), weights
