"""The sparse mixture-of-experts feed-forward of the Llama-family MoE decoders (Mixtral, Qwen2-MoE), with the
module names and keys of ``transformers``' ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``:

- ``gate`` (``TopKRouter``, replicated), ``experts`` (``StackedExperts``: ``gate_up_proj``, ``down_proj``, split
  over the expert-parallel group by the plan's ``ExpertParallel`` style);
- Qwen2-MoE only: ``shared_expert`` (a ``GatedMLP`` every token goes through, tensor-parallel like a dense MLP) and
  ``shared_expert_gate`` (``[1, h]``, replicated): output ``experts + sigmoid(shared_expert_gate(x)) *
  shared_expert(x)``.

Input/output ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism); the router logits ``[b*s, E]`` of each
call (always the whole sequence) are appended to ``router_logits`` when a collector (``RouterLogits``) is passed
(what ``output_router_logits`` returns and the load-balancing loss reads).
Collectives: the dispatch/combine all-to-alls over ``ep`` (``parallel_layers/moe/dispatch.py``), the experts' over
``etp`` (``parallel_layers/moe/experts.py``), and the shared expert's TP ones.

Sequence parallelism: the routed part works on the whole sequence, as outside sequence parallelism. The block
all-gathers its ``[b, s/tp, h]`` input over tp (backward: this rank's slice, every rank's gradient being the same
full one), routes and runs the experts, and hands back this rank's slice; when the experts are split over the whole
tp group (``expert_tensor_parallel_size == tensor_parallel_size``, Megatron's default) their partial outputs are
combined first and reduce-scattered over tp (Megatron's order: experts, combine, reduce-scatter), otherwise the
combined output is whole and sliced. The router, its loss and statistics therefore see exactly the tokens
``transformers`` sees. The shared expert runs on the local slice like a dense sequence-parallel MLP.

2D / 2.5D grid (experts replicated: ``expert_parallel_size = expert_tensor_parallel_size = 1``): the input is
``[b/(dq), s, h/q]`` (batch block over the grid column and depth, hidden block over the row). The block all-gathers
the hidden over the row (backward: this rank's slice, not a reduce-scatter: every rank of the row computes the same
whole-token gradient), routes this batch block's whole tokens through the whole router and experts, and hands back
this rank's hidden block (backward: all-gather over the row). The q ranks of a row so duplicate the routed work of
their batch block and each holds its complete router and expert gradients; ``GridReplicated`` / the experts'
``grid`` sum those over the column and depth (``tensor_parallel_2d.replicated_over_batch``, as the grid's norms and
biases). Qwen2-MoE's shared-expert gate scales this rank's hidden block of the shared expert's output, so its
gradient is summed over the row. The load-balancing statistics are summed over the batch groups
(``context_parallel.sum_over_replica_tokens``). 3D is refused (its activations take two layouts in a block).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ....parallel_layers.layers import Linear
from ....parallel_layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    group_size,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from ....parallel_layers.moe import ExpertParallel, StackedExperts, TopKRouter, combine, dispatch, router_jitter
from ....parallel_layers.plan import Colwise, GridReplicated, Rowwise
from ....parallel_layers.sequence_parallel import SequenceParallelAware
from ....parallel_layers.tensor_parallel_2d import replicated_over_batch
from ..rules.parallel_rules import Features
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


class SparseMoeBlock(SequenceParallelAware, nn.Module):
    # the plan fragment: stacked experts split over the expert-parallel group (contiguous blocks of E/ep; not over
    # tensor parallelism, see parallel_layers/moe/experts.py); the router and the shared expert's gate replicated;
    # the shared expert (Qwen2-MoE) column-/row-parallel like a dense MLP
    # (GridReplicated: unchanged at 1D; under the 2D / 2.5D grid their gradients are summed over its batch groups)
    tp_plan = {"experts": ExpertParallel(), "gate": GridReplicated(), "shared_expert_gate": GridReplicated(),
               "shared_expert.gate_proj": Colwise(), "shared_expert.up_proj": Colwise(),
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
        routed = route_tokens(self, hidden_states, self.gate, self.experts, router_logits=router_logits,
                              jitter_noise=self.jitter_noise)
        out = routed.out
        if hasattr(self, "shared_expert"):
            gate = F.sigmoid(self._shared_gate_logit(routed.tokens)).reshape(*routed.shape[:-1], 1)
            if routed.sequence_parallel:
                gate = scatter_to_sequence_parallel_region(gate, self.experts.tp_group)
            elif routed.grid is not None:  # it scales this rank's hidden block: its gradient is summed over the row
                gate = copy_to_tensor_parallel_region(gate, routed.grid.row.group)
            out = out + gate * self.shared_expert(hidden_states)
        return out

    def _shared_gate_logit(self, tokens: torch.Tensor) -> torch.Tensor:
        """``shared_expert_gate(tokens)`` (``[T, 1]``, no bias); under the grid with its weight's gradient summed
        over the batch groups (``GridReplicated``)."""
        layer = self.shared_expert_gate
        grid = getattr(layer, "grid", None)
        return layer(tokens) if grid is None else F.linear(tokens, replicated_over_batch(layer.weight, grid))


class Routed(NamedTuple):
    """What ``route_tokens`` returns: ``out`` (the experts' weighted sum, in the input's layout: ``[b, s/tp, h]``
    under sequence parallelism), ``tokens`` (``[b*s, h]``: the whole sequence the router saw), ``shape`` (its
    ``[b, s, h]``), ``sequence_parallel`` (whether the call ran sequence-parallel), ``grid`` (the 2D / 2.5D
    ``Grid`` the call gathered the hidden over, else ``None``)."""

    out: torch.Tensor
    tokens: torch.Tensor
    shape: torch.Size
    sequence_parallel: bool
    grid: object = None


def route_tokens(block: SequenceParallelAware, local: torch.Tensor, router: nn.Module, experts, *,
                 router_logits: RouterLogits | None = None, jitter_noise: float = 0.0) -> Routed:
    """The routed part of every MoE block: ``local`` (``[b, s, h]``, or ``[b, s/tp, h]`` when ``block`` runs
    sequence-parallel) through ``router`` (``flat [T, h] -> logits, weights, index``) and the (expert-parallel)
    ``experts``: dispatch by all-to-all over ``ep``, the grouped expert run, the weighted combine back.

    Sequence parallelism (see the module docstring): all-gather over tp first (backward: this rank's slice), route
    the whole sequence, then hand back this rank's slice: reduce-scatter of the partial sums when the experts are
    split over the whole tp group (``etp == tp``), else a slice of the whole output.

    2D / 2.5D grid (``experts.grid`` set, see the module docstring): ``local`` is ``[b/(dq), s, h/q]``; all-gather
    the hidden over the grid row (backward: this rank's slice), route this batch block's whole tokens, hand back
    this rank's hidden block (backward: all-gather over the row)."""
    tp_group, grid = experts.tp_group, getattr(experts, "grid", None)
    sequence_parallel = block.sequence_parallel_active() and group_size(tp_group) > 1
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(local, tp_group, grad_is_partial=False)
    elif grid is not None:
        hidden = gather_from_tensor_parallel_region(local, grid.row.group, dim=-1)
    else:
        hidden = local
    shape = hidden.shape
    hidden = router_jitter(hidden, jitter_noise, block.training)
    flat = hidden.reshape(-1, shape[-1])
    logits, weights, index = router(flat)
    if router_logits is not None:
        router_logits.append(logits)
    # experts split over the whole tp group under sequence parallelism: combine their partial sums, then
    # reduce-scatter (one collective instead of an all-reduce and a slice)
    partial = sequence_parallel and group_size(experts.etp_group) == group_size(tp_group)
    routed = dispatch(flat, index, experts.num_experts, experts.group)
    expert_out = experts(routed.rows, routed.local_counts, reduce_output=not partial)
    if partial:  # the weights then multiply partial sums: their gradient is summed over tp
        weights = copy_to_tensor_parallel_region(weights, tp_group)
    out = combine(expert_out, routed, weights, flat.shape[0], experts.group).reshape(shape)
    if partial:
        out = reduce_scatter_to_sequence_parallel_region(out, tp_group)
    elif sequence_parallel:
        out = scatter_to_sequence_parallel_region(out, tp_group)
    elif grid is not None:
        out = scatter_to_tensor_parallel_region(out, grid.row.group, dim=-1)
    return Routed(out, flat, shape, sequence_parallel, grid)


def check_expert_layout(name: str, num_experts: int, parallel, *, expert_intermediate_size: int | None = None,
                        sequence_parallel: bool = False, grid: bool = False) -> None:
    """The layout checks every mixture-of-experts family shares, before any process group exists: experts split
    evenly over ``expert_parallel_size``, each expert's feed-forward (``expert_intermediate_size``) evenly over
    ``expert_tensor_parallel_size``; ``sequence_parallel=False``: a family whose MoE block does not run
    sequence-parallel, ``grid=False``: one whose MoE block does not run on the 2D / 2.5D grid (NotImplementedError);
    3D is refused for every family. (``config.py`` refuses experts split over ep or etp under any grid mode.)"""
    ep, etp = parallel.expert_parallel_size, parallel.expert_tensor_parallel_size
    if num_experts % ep:
        raise ValueError(f"{name}: the {num_experts} experts of each layer cannot be split over "
                         f"expert_parallel_size={ep}; use a divisor of {num_experts}")
    if etp > 1 and (expert_intermediate_size is None or expert_intermediate_size % etp):
        what = ("this family's experts cannot be split" if expert_intermediate_size is None
                else f"the expert feed-forward size {expert_intermediate_size} is not divisible by it")
        raise ValueError(f"{name}: expert_tensor_parallel_size={etp}: {what}")
    mode = parallel.tensor_parallel_mode
    if mode == "3d":
        raise NotImplementedError(f"{name}: tensor_parallel_mode='3d' with mixture-of-experts layers is not "
                                  "implemented (the cube's activations take two layouts inside a block; the MoE "
                                  "block gathers the hidden over the 2D / 2.5D grid's row); use "
                                  "tensor_parallel_mode='2d', '2.5d' or '1d'")
    if mode not in ("1d", "3d") and not grid:
        raise NotImplementedError(f"{name}: tensor_parallel_mode={mode!r} with this family's mixture-of-experts "
                                  "block is not implemented (the grid splits every activation over batch and "
                                  "hidden; only the SparseMoeBlock decoders gather whole tokens for their router "
                                  "and experts); use tensor_parallel_mode='1d'")
    if parallel.sequence_parallel and not sequence_parallel:
        raise NotImplementedError(f"{name}: sequence_parallel with mixture-of-experts layers is not "
                                  "implemented; use tensor_parallel_size without sequence_parallel")
