"""The sparse mixture-of-experts feed-forward of the Llama-family MoE decoders (Mixtral, Qwen2-MoE), with the
module names and keys of ``transformers``' ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``:

- ``gate`` (``TopKRouter``, replicated), ``experts`` (``StackedExperts``: ``gate_up_proj``, ``down_proj``, split
  over the expert-parallel group by the plan's ``ExpertParallel`` style);
- Qwen2-MoE only: ``shared_expert`` (a ``GatedMLP`` every token goes through, tensor-parallel like a dense MLP) and
  ``shared_expert_gate`` (``[1, h]``, replicated): output ``experts + sigmoid(shared_expert_gate(x)) *
  shared_expert(x)``.

Input/output ``[b, s, h]``; the router logits ``[b*s, E]`` of each call are appended to ``router_logits`` when a
collector (``RouterLogits``) is passed (what ``output_router_logits`` returns and the load-balancing loss reads).
Collectives: the dispatch/combine all-to-alls over ``ep`` (``parallel_layers/moe/dispatch.py``), and the shared
expert's TP ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel_layers.layers import Linear
from ...parallel_layers.plan import Colwise, Rowwise
from .parallel_rules import Features
from ...parallel_layers.moe import ExpertParallel, StackedExperts, TopKRouter, combine, dispatch, router_jitter
from .mlp import GatedMLP


class RouterLogits:
    """Collects each sparse layer's router logits during one forward, in call order (``append``; ``.logits``).

    An object, not a list: wrappers that pass the forward's arguments on through pytree maps (FSDP2's root
    pre-forward under ZeRO-2/3, Accelerate's input casting) rebuild lists, tuples and dicts, so appends to a passed
    list would be lost; a plain object is a leaf they hand on as is."""

    def __init__(self):
        self.logits: list = []

    def append(self, logits) -> None:
        self.logits.append(logits)


class SparseMoeBlock(nn.Module):
    # the plan fragment: stacked experts split over the expert-parallel group (contiguous blocks of E/ep; not over
    # tensor parallelism, see parallel_layers/moe/experts.py); the router and the shared expert's gate replicated;
    # the shared expert (Qwen2-MoE) column-/row-parallel like a dense MLP
    tp_plan = {"experts": ExpertParallel(), "shared_expert.gate_proj": Colwise(), "shared_expert.up_proj": Colwise(),
               "shared_expert.down_proj": Rowwise()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        shared = getattr(config, "shared_expert_intermediate_size", None)
        return [Features("shared_expert_intermediate_size", shared)] if shared else []

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, intermediate_size: int, act: str,
                 normalize: bool, weights_in_logits_dtype: bool = False, jitter_noise: float = 0.0,
                 shared_expert_intermediate_size: int | None = None):
        super().__init__()
        self.top_k, self.jitter_noise = top_k, jitter_noise
        self.gate = TopKRouter(hidden_size, num_experts, top_k, normalize=normalize,
                               weights_in_logits_dtype=weights_in_logits_dtype)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, act=act)
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, act=act)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor, *, router_logits: RouterLogits | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_states = router_jitter(hidden_states, self.jitter_noise, self.training)
        flat = hidden_states.reshape(-1, shape[-1])
        logits, weights, index = self.gate(flat)
        if router_logits is not None:
            router_logits.append(logits)
        group = self.experts.group
        routed = dispatch(flat, index, self.experts.num_experts, group)
        out = combine(self.experts(routed.rows, routed.local_counts), routed, weights, flat.shape[0], group)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(hidden_states).reshape(-1, shape[-1])
            out = out + F.sigmoid(self.shared_expert_gate(flat)) * shared
        return out.reshape(shape)


def check_expert_layout(name: str, num_experts: int, parallel) -> None:
    """The layout checks every mixture-of-experts family shares, before any process group exists: experts split
    evenly over ``expert_parallel_size``; no sequence parallelism (the router and the capacity rule see whole
    sequences)."""
    ep = parallel.expert_parallel_size
    if num_experts % ep:
        raise ValueError(f"{name}: the {num_experts} experts of each layer cannot be split over "
                         f"expert_parallel_size={ep}; use a divisor of {num_experts}")
    if parallel.sequence_parallel:
        raise NotImplementedError(f"{name}: sequence_parallel with mixture-of-experts layers is not "
                                  "implemented; use tensor_parallel_size without sequence_parallel")
