"""Stacked experts: every expert of a layer in two 3-D tensors, run as one batched matmul, split over ``ep``.

Two expert shapes:

- ``StackedExperts`` (SwiGLU): layout and keys are ``transformers`` 5.x's (``MixtralExperts``,
  ``Qwen2MoeExperts``): ``gate_up_proj`` ``[E, 2*i, h]`` (gate rows, then up rows) and ``down_proj`` ``[E, h, i]``.
- ``StackedDenseExperts`` (T5's ``DenseActDense``, the Switch Transformers expert): ``wi`` ``[E, f, d]`` and
  ``wo`` ``[E, d, f]``, with a dropout between them; ``transformers`` keeps these as one module per expert
  (``experts.expert_{i}.wi``), which ``models/common/expert_keys.py`` maps to and from the stacked tensors.

Under expert parallelism each rank holds its contiguous block of ``E/ep`` experts (``EvenSplit(0, axis="ep")``, so
the loader reads only those rows and the saver all-gathers them over ``ep``). Experts are not split over tensor
parallelism: every tp rank of an ep rank holds the same experts and runs the same tokens (the residual stream is
replicated over tp outside sequence parallelism), so expert gradients are equal over tp and counted once by the
gradient norm.

The local experts run as one grouped computation: rows grouped by expert are laid out as ``[E_local, C, h]``
(``C`` = the largest expert's row count, zero rows padding the others) and multiplied with ``torch.bmm``, not a
Python loop over experts. Both weights are used on every call, even with no rows, so their gradients exist on
every rank (the expert-data-parallel gradient hooks rely on it).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..layers import Dropout
from ..mappings import group_rank, group_size
from ..plan import Style, refuse_grid_mode
from ..sharding import EvenSplit
from ..tensor_parallel import divide


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, weight, scale):
        ctx.scale = scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _GroupedExperts(nn.Module):
    """Stacked expert weights (``weight_names``, dim 0 = experts) and the grouped run of the local experts.

    ``forward(rows [R, h], counts [E_local])``: ``rows`` grouped by local expert, ``counts[e]`` rows each.
    Returns ``[R, h]``. No communication (dispatch/combine move the rows).
    """

    weight_names: tuple[str, ...] = ()

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts  # of the whole layer
        self.group = None  # expert-parallel group; set by ExpertParallel
        self.first_expert = 0
        # ZeRO-2/3 (training/zero.py) sets 1/ep: FSDP2 averages the experts' gradients over edp, they must be
        # summed over edp and divided by dp (FSDP2's own divide factor needs PREMUL_SUM, which gloo lacks)
        self.gradient_scale = 1.0

    def weight(self, name: str) -> torch.Tensor:
        """The stacked weight ``name`` as the forward uses it (its gradient scaled by ``gradient_scale``)."""
        weight = getattr(self, name)
        return weight if self.gradient_scale == 1.0 else _ScaleGradient.apply(weight, self.gradient_scale)

    @property
    def num_local_experts(self) -> int:
        return getattr(self, self.weight_names[0]).shape[0]

    def shard(self, group) -> "StackedExperts":
        """Keep this rank's ``E/ep`` experts (shapes only: called before the weights are loaded)."""
        ep = group_size(group)
        local = divide(self.num_experts, ep, "number of experts")
        self.group, self.first_expert = group, group_rank(group) * local
        for name in self.weight_names:
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(old.new_empty((local, *old.shape[1:])), requires_grad=old.requires_grad))
        return self

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local, hidden = self.num_local_experts, rows.shape[-1]
        capacity = int(counts.max()) if counts.numel() else 0
        offsets = torch.cumsum(counts, 0) - counts
        expert = torch.repeat_interleave(torch.arange(local, device=rows.device), counts)
        slot = torch.arange(rows.shape[0], device=rows.device) - offsets.index_select(0, expert)
        padded = rows.new_zeros((local, capacity, hidden)).index_put((expert, slot), rows)
        return self.run(padded)[expert, slot]

    def run(self, padded: torch.Tensor) -> torch.Tensor:
        """``[E_local, C, h]`` (expert ``e``'s rows, zero-padded to ``C``) -> ``[E_local, C, h]``."""
        raise NotImplementedError


class StackedExperts(_GroupedExperts):
    """``E`` SwiGLU experts ``down(act(gate(x)) * up(x))`` in stacked weights (Mixtral, Qwen2-MoE)."""

    weight_names = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, act: str = "silu"):
        super().__init__(num_experts)
        self.hidden_dim, self.intermediate_dim = hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = ACT2FN[act]

    def run(self, padded: torch.Tensor) -> torch.Tensor:
        gate, up = torch.bmm(padded, self.weight("gate_up_proj").transpose(1, 2)).chunk(2, dim=-1)  # [E_l, C, i]
        return torch.bmm(self.act_fn(gate) * up, self.weight("down_proj").transpose(1, 2))  # [E_l, C, h]


class StackedDenseExperts(_GroupedExperts):
    """``E`` T5-style experts ``wo(dropout(act(wi(x))))`` in stacked weights (Switch Transformers'
    ``SwitchTransformersDenseActDense`` per expert). The dropout acts on whole (not tensor-split) activations."""

    weight_names = ("wi", "wo")

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, act: str = "relu", dropout: float = 0.0):
        super().__init__(num_experts)
        self.wi = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.wo = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.act = ACT2FN[act]
        self.dropout = Dropout(dropout)

    def run(self, padded: torch.Tensor) -> torch.Tensor:
        hidden = self.dropout(self.act(torch.bmm(padded, self.weight("wi").transpose(1, 2))))  # [E_l, C, f]
        return torch.bmm(hidden.to(self.wo.dtype), self.weight("wo").transpose(1, 2))  # [E_l, C, d]


class ExpertParallel(Style):
    """Plan style of stacked experts (``StackedExperts``, ``StackedDenseExperts``): split dim 0 (experts) over the
    expert-parallel group."""

    hf_style = None  # not a tensor-parallel style (transformers lists it in base_model_ep_plan as "grouped_gemm")

    def build(self, module, context):
        refuse_grid_mode(context, "mixture-of-experts layers")
        return module.shard(context.ep_group)

    def layouts(self, module):
        return {name: EvenSplit(0, axis="ep") for name in module.weight_names}
