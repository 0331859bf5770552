"""Causal self-attention with one fused ``query_key_value`` projection of grouped heads and an output ``dense``: the
attention of Bloom and Falcon (module names and keys as there), written single-device.

The fused output is ``groups`` groups of ``[q_1 .. q_G, k, v]`` heads (``parallel_layers/grouped_qkv.py``: Bloom and
Falcon's ``multi_query=False`` per head ``[q, k, v]``, Falcon's multi-query ``[q_1 .. q_n, k, v]``, its new
architecture per key/value head). A family subclass says which with ``qkv_groups(config)`` (default: one group per
head). Position information comes from rotary ``(cos, sin)`` (Falcon; ``rotary=True``) or from the mask: ALiBi is an
additive per-head bias the stack builds into this rank's mask (``positions.alibi_attention_mask``), so this module
needs no switch for it. The kernel is ``transformers``' attention interface (SDPA by default, Llama's eager kernel
for ``"eager"``), which repeats each key/value head for its ``G`` query heads.

Under tensor parallelism ``query_key_value`` is split by whole groups, or within a group with its key/value head
replicated (``GroupedQKVColwise``), so rank ``r`` holds query heads ``r*n/tp ..`` and their keys and values; ``dense``
is row-parallel (its all-reduce / reduce-scatter is the only forward collective).

Shapes: input/output ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism); inside ``query [b, n/tp, s, d]``,
``key``/``value [b, g_local, s, d]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from ....parallel_layers.grouped_qkv import GroupedQKVColwise, GroupedQKVLinear
from ....parallel_layers.layers import Dropout, Linear
from ....parallel_layers.plan import Rowwise, TPDropout
from ..embeddings.rotary import apply_rotary
from ..rules.parallel_rules import Heads, Rule
from ..stack.fused_kernels import FusedKernels
from .attention import AttentionModule, attend


@dataclass(frozen=True)
class QKVGroups(Rule):
    """``value`` query/key/value head groups of ``query_heads // value`` query heads each: ``tp`` must divide the
    groups, or be a multiple of them whose share of a group divides its query heads (replicated key/value heads)."""

    query_heads: int = 0

    def check_grid(self, parallel, model_type):
        raise NotImplementedError(f"{model_type}: a fused query_key_value of grouped heads under "
                                  f"tensor_parallel_mode={parallel.tensor_parallel_mode!r} is not implemented; "
                                  "use tensor_parallel_mode='1d'")

    def check_tp(self, tp, model_type):
        groups = self.value
        if tp <= groups:
            super().check_tp(tp, model_type)
        elif tp % groups or self.query_heads // groups % (tp // groups):
            raise ValueError(f"{model_type}: tensor_parallel_size={tp} exceeds {self.name}={groups} but does not "
                             f"split each group's {self.query_heads // groups} query heads evenly over "
                             f"{tp}/{groups} ranks while replicating its key/value head")


class GroupedQKVAttention(FusedKernels, AttentionModule):
    """See the module docstring. ``forward(hidden_states, position_embeddings=None, attention_mask=None,
    past_key_values=None)`` -> ``(output, weights)``; ``weights`` only with the eager kernel."""

    tp_plan = {"query_key_value": GroupedQKVColwise(), "dense": Rowwise(),
               "attention_dropout": TPDropout(always_split=True), "output_dropout": TPDropout()}

    @classmethod
    def qkv_groups(cls, config) -> int:
        """How many ``[q.., k, v]`` groups ``query_key_value`` holds (default: one per head, ``[q, k, v]``)."""
        return config.num_attention_heads

    @classmethod
    def parallel_rules(cls, config) -> list:
        heads, groups = config.num_attention_heads, cls.qkv_groups(config)
        if heads % groups:
            raise ValueError(f"{config.model_type}: num_attention_heads={heads} is not a multiple of the "
                             f"{groups} query/key/value groups")
        return [Heads("num_attention_heads", heads), QKVGroups("key/value head groups", groups, heads)]

    def __init__(self, config, layer_idx: int, *, bias: bool = True, rotary: bool = False,
                 attention_dropout: float = 0.0, output_dropout: float = 0.0):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        num_heads, groups = config.num_attention_heads, self.qkv_groups(config)
        self.head_dim = config.hidden_size // num_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.rotary = rotary
        self.query_key_value = GroupedQKVLinear(config.hidden_size, num_groups=groups,
                                                q_per_group=num_heads // groups, head_dim=self.head_dim, bias=bias)
        self.dense = Linear(num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.attention_dropout = Dropout(attention_dropout)
        self.output_dropout = Dropout(output_dropout)

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head on this rank (what the attention kernels repeat key/value by)."""
        return self.query_key_value.local_q_per_group

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query [b, n/tp, s, d]``, ``key``/``value [b, g_local, s, d]`` from this rank's fused output."""
        fused = self.query_key_value(hidden_states)  # [b, s, g_local*(G_local+2)*d]
        per_group = self.query_key_value.local_q_per_group
        fused = fused.view(*fused.shape[:2], -1, per_group + 2, self.head_dim)  # [b, s, g_local, G_local+2, d]
        query = fused[..., :per_group, :].flatten(2, 3).transpose(1, 2)
        key, value = (fused[..., per_group + i, :].transpose(1, 2) for i in (0, 1))
        return query, key, value

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        query, key, value = self.project(hidden_states)
        if self.rotary:
            cos, sin = position_embeddings
            query, key = apply_rotary(query, key, cos, sin, fused=self.fused)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attention_dropout,
                              scaling=self.scaling, eager_fallback=eager_attention_forward, **kwargs)
        return self.output_dropout(self.dense(out)), weights  # [b, s(/tp), h]
