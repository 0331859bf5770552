"""T5-style feed-forward blocks (``transformers``' ``T5DenseActDense`` / ``T5DenseGatedActDense``, the same
modules mT5, UMT5 and LongT5 use), written with plain layers for a Megatron split.

``wi`` (and ``wi_0``/``wi_1``) are column-parallel: input ``[b, s, d_model]`` (``[b, s/tp, d_model]`` under
sequence parallelism: each gathers the sequence), output ``[b, s, d_ff/tp]``. ``wo`` is row-parallel: it
all-reduces (or reduce-scatters) back to ``d_model``. The dropout between them acts on TP-split activations.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ...parallel_layers.layers import Dropout, Linear


class DenseActDense(nn.Module):
    """``wo(dropout(act(wi(x))))`` (original T5: ReLU)."""

    def __init__(self, d_model: int, d_ff: int, *, act: str, dropout: float):
        super().__init__()
        self.wi = Linear(d_model, d_ff, bias=False)
        self.wo = Linear(d_ff, d_model, bias=False)
        self.dropout = Dropout(dropout)
        self.act = ACT2FN[act]

    def forward(self, hidden_states: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        hidden_states = self.act(self.wi(hidden_states, sequence_parallel=sequence_parallel))  # [b, s, d_ff/tp]
        hidden_states = self.dropout(hidden_states)
        return self.wo(hidden_states.to(self.wo.weight.dtype), sequence_parallel=sequence_parallel)


class DenseGatedActDense(nn.Module):
    """``wo(dropout(act(wi_0(x)) * wi_1(x)))`` (T5 v1.1 / Flan-T5: gated GELU). Each rank gates its own
    ``d_ff/tp`` columns of both branches, so the product needs no communication."""

    def __init__(self, d_model: int, d_ff: int, *, act: str, dropout: float):
        super().__init__()
        self.wi_0 = Linear(d_model, d_ff, bias=False)
        self.wi_1 = Linear(d_model, d_ff, bias=False)
        self.wo = Linear(d_ff, d_model, bias=False)
        self.dropout = Dropout(dropout)
        self.act = ACT2FN[act]

    def forward(self, hidden_states: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        gate = self.act(self.wi_0(hidden_states, sequence_parallel=sequence_parallel))
        hidden_states = self.dropout(gate * self.wi_1(hidden_states, sequence_parallel=sequence_parallel))
        # the cast keeps a fp32 ``wo`` (Flan-T5 in 8-bit setups) working, as transformers does
        return self.wo(hidden_states.to(self.wo.weight.dtype), sequence_parallel=sequence_parallel)
