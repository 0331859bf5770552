"""Mixture-of-experts feed-forwards whose router or experts differ from ``SparseMoeBlock``'s, as components of their
own (each carries its ``tp_plan`` fragment and ``parallel_rules``), with ``transformers``' module names and keys:

- ``SharedExpertsMoe`` (DeepSeek-V3's ``DeepseekV3MoE``): ``experts`` (``StackedExperts``, SwiGLU, split over
  ``ep``), ``gate`` (``GroupLimitedRouter``: sigmoid scores, correction bias, group-limited top-k, scaled weights;
  replicated) and ``shared_experts`` (one SwiGLU MLP of ``moe_intermediate_size * n_shared_experts`` every token
  goes through, unweighted; column-/row-parallel like a dense MLP). Output ``experts(x) + shared_experts(x)``.
- ``ClampedSwigluMoe`` (gpt-oss's ``GptOssMLP``): ``router`` (``BiasedTopKRouter``; replicated) and ``experts``
  (``ClampedSwigluExperts``: biases, interleaved gate|up, clamped SwiGLU; split over ``ep``).

Input/output ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism); ``forward(x, router_logits=collector)``
appends the router logits ``[b*s, E]`` to a ``RouterLogits`` collector as ``SparseMoeBlock`` does. The routed part
is ``SparseMoeBlock``'s (``moe.route_tokens``: the whole sequence routed on every tp rank, sequence parallelism by
an all-gather in and a slice or reduce-scatter out); the shared experts run on the local slice like a dense
sequence-parallel MLP. Collectives: the dispatch/combine all-to-alls over ``ep``
(``parallel_layers/moe/dispatch.py``), the sequence-parallel gather/scatter over tp, the shared experts' TP ones.
"""
from __future__ import annotations

import torch
from torch import nn

from ....parallel_layers.moe import ExpertParallel, StackedExperts
from ....parallel_layers.moe.clamped_experts import ClampedSwigluExperts
from ....parallel_layers.moe.router_variants import BiasedTopKRouter, GroupLimitedRouter
from ....parallel_layers.plan import Colwise, Rowwise
from ....parallel_layers.sequence_parallel import SequenceParallelAware
from .mlp import GatedMLP
from .moe import route_tokens


class SharedExpertsMoe(SequenceParallelAware, nn.Module):
    """DeepSeek-V3's MoE block (see the module docstring). Registered in ``transformers``' order: ``experts``,
    ``gate``, ``shared_experts``."""

    tp_plan = {"experts": ExpertParallel(), "shared_experts.gate_proj": Colwise(),
               "shared_experts.up_proj": Colwise(), "shared_experts.down_proj": Rowwise()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        from ..rules.parallel_rules import Features

        shared = getattr(config, "n_shared_experts", None)
        return [Features("moe_intermediate_size * n_shared_experts", config.moe_intermediate_size * shared)] \
            if shared else []

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, intermediate_size: int, act: str,
                 n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                 shared_intermediate_size: int):
        super().__init__()
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, act=act)
        self.gate = GroupLimitedRouter(hidden_size, num_experts, top_k, n_group=n_group, topk_group=topk_group,
                                       norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
        self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, act=act)

    def forward(self, hidden_states: torch.Tensor, *, router_logits=None) -> torch.Tensor:
        routed = route_tokens(self, hidden_states, self.gate, self.experts, router_logits=router_logits)
        return routed.out + self.shared_experts(hidden_states)  # a dense (sequence-parallel) MLP on the local slice


class ClampedSwigluMoe(SequenceParallelAware, nn.Module):
    """gpt-oss's MoE block (see the module docstring). Registered as ``transformers``: ``router``, ``experts``."""

    tp_plan = {"experts": ExpertParallel()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return []

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, intermediate_size: int, alpha: float,
                 limit: float):
        super().__init__()
        self.router = BiasedTopKRouter(hidden_size, num_experts, top_k)
        self.experts = ClampedSwigluExperts(num_experts, hidden_size, intermediate_size, alpha=alpha, limit=limit)

    def forward(self, hidden_states: torch.Tensor, *, router_logits=None) -> torch.Tensor:
        return route_tokens(self, hidden_states, self.router, self.experts, router_logits=router_logits).out
