"""Stacked experts: every expert of a layer in two 3-D tensors, run as grouped matmuls, split over ``ep``.

Two expert shapes:

- ``StackedExperts`` (SwiGLU): layout and keys are ``transformers`` 5.x's (``MixtralExperts``,
  ``Qwen2MoeExperts``): ``gate_up_proj`` ``[E, 2*i, h]`` (gate rows, then up rows) and ``down_proj`` ``[E, h, i]``.
- ``StackedDenseExperts`` (T5's ``DenseActDense``, the Switch Transformers expert): ``wi`` ``[E, f, d]`` and
  ``wo`` ``[E, d, f]``, with a dropout between them; ``transformers`` keeps these as one module per expert
  (``experts.expert_{i}.wi``), which ``models/common/loading/expert_keys.py`` maps to and from the stacked tensors.

Under expert parallelism each rank holds its contiguous block of ``E/ep`` experts (``EvenSplit(0, axis="ep")``, so
the loader reads only those rows and the saver all-gathers them over ``ep``). By default experts are not split over
tensor parallelism: every tp rank of an ep rank holds the same experts and runs the same tokens (the MoE block sees
the whole sequence on every tp rank, see ``models/common/feed_forward/moe.py``), so expert gradients are equal over tp
and counted once by the gradient norm.

Expert tensor parallelism (``expert_tensor_parallel_size = k``, group ``etp`` = ``k`` consecutive tp ranks): each
expert's feed-forward is split Megatron-style, the first projection column-parallel (``gate_up_proj`` rows: this
rank's ``i/k`` gate rows, then its ``i/k`` up rows; ``wi`` rows), the second row-parallel (``down_proj`` / ``wo``
columns). Layout ``ExpertTensorSplit``: dim 0 over ``ep`` and the feed-forward dim over ``etp``, so the loader reads
only this rank's slice of its experts and the saver gathers over both. Collectives in ``forward``: the rows enter
with ``copy_to_tensor_parallel_region`` (backward: all-reduce over etp of the partial input gradients) and leave with
an all-reduce over etp of the partial outputs (or, with ``reduce_output=False``, the caller reduces them: a
reduce-scatter after the combine under sequence parallelism).

The local experts run dropless: rows sorted by expert go through one grouped matmul per projection
(``grouped_mm.py``: ``torch``'s grouped-GEMM kernel on CUDA, a loop of matmuls over contiguous slices on CPU), no
row padded to a capacity; ``expert_implementation = "padded"`` runs the ``[E_local, C, h]`` ``torch.bmm`` baseline
instead (the same numbers). Each expert class writes its feed-forward once (``run(x, grouping)``) for both.
Both weights are used on every call, even with no rows, so their gradients exist on every rank (the
expert-data-parallel gradient hooks rely on it).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..layers import Dropout
from ..mappings import (
    copy_to_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
)
from ..plan import Style, grid_batch_replicated
from ..sharding import EvenSplit, GridBlock, Layout, PackedSplit
from ..tensor_parallel import divide
from ..tensor_parallel_2d import replicated_over_batch
from .grouped_mm import IMPLEMENTATIONS, Grouping, run_padded


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
    # expert tensor parallelism: each weight's layout over "etp" (its feed-forward dim); a weight missing here
    # cannot be split over etp, unless ``etp_replicated`` names it (whole on every etp rank, e.g. an output bias)
    etp_layouts: dict[str, Layout] = {}
    etp_replicated: tuple[str, ...] = ()

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts  # of the whole layer
        self.group = None  # expert-parallel group; set by ExpertParallel
        self.etp_group = None  # expert-tensor-parallel group; set by ExpertParallel
        self.tp_group = None  # the tensor-parallel group (the MoE block's sequence-parallel boundary); idem
        self.first_expert = 0
        # ZeRO-2/3 (training/zero.py) sets 1/ep: FSDP2 averages the experts' gradients over edp, they must be
        # summed over edp and divided by dp (FSDP2's own divide factor needs PREMUL_SUM, which gloo lacks)
        self.gradient_scale = 1.0
        # 2D / 2.5D: the Grid (plan.grid_batch_replicated); the experts see this rank's batch block only, so their
        # gradients are summed over the grid's batch groups (every rank of a grid row holds the same ones)
        self.grid = None
        self.expert_implementation = "grouped"  # or "padded" (grouped_mm.set_expert_implementation)

    def weight(self, name: str) -> torch.Tensor:
        """The stacked weight ``name`` as the forward uses it (its gradient scaled by ``gradient_scale``)."""
        weight = getattr(self, name)
        if self.grid is not None:
            weight = replicated_over_batch(weight, self.grid)
        return weight if self.gradient_scale == 1.0 else _ScaleGradient.apply(weight, self.gradient_scale)

    @property
    def num_local_experts(self) -> int:
        return getattr(self, self.weight_names[0]).shape[0]

    def shard(self, group, etp_group=None) -> "StackedExperts":
        """Keep this rank's ``E/ep`` experts, and of each its ``1/etp`` slice of the feed-forward (shapes only:
        called before the weights are loaded)."""
        ep, etp = group_size(group), group_size(etp_group)
        local = divide(self.num_experts, ep, "number of experts")
        self.group, self.first_expert = group, group_rank(group) * local
        self.etp_group = etp_group if etp > 1 else None
        for name in self.weight_names:
            old = getattr(self, name)
            shape = (local, *old.shape[1:])
            if etp > 1 and name not in self.etp_replicated:
                if name not in self.etp_layouts:
                    raise NotImplementedError(f"{type(self).__name__}.{name} cannot be split over "
                                              f"expert_tensor_parallel_size={etp}")
                shape = self.etp_layouts[name].local_shape(shape, etp)
            setattr(self, name, nn.Parameter(old.new_empty(shape), requires_grad=old.requires_grad))
        return self

    def expert_layouts(self) -> dict[str, Layout]:
        """Each stacked weight's layout: experts over ``ep``; with expert tensor parallelism also the feed-forward
        dim over ``etp``."""
        if self.etp_group is None:
            return {name: EvenSplit(0, axis="ep") for name in self.weight_names}
        return {name: EvenSplit(0, axis="ep") if name in self.etp_replicated
                else ExpertTensorSplit(EvenSplit(0, axis="ep"), self.etp_layouts[name]) for name in self.weight_names}

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, *, reduce_output: bool = True) -> torch.Tensor:
        """``reduce_output=False`` under expert tensor parallelism: return this rank's partial sums (the caller
        reduces them over etp, e.g. after the combine)."""
        if self.expert_implementation not in IMPLEMENTATIONS:
            raise ValueError(f"expert_implementation {self.expert_implementation!r} is not one of {IMPLEMENTATIONS}")
        if self.etp_group is not None:  # replicated rows into a column-parallel projection
            rows = copy_to_tensor_parallel_region(rows, self.etp_group)
        if self.expert_implementation == "padded":
            out = run_padded(self.run, rows, counts)
        else:
            out = self.run(rows, Grouping(counts, rows.shape[0]))
        if self.etp_group is not None and reduce_output:  # row-parallel partial sums
            out = reduce_from_tensor_parallel_region(out, self.etp_group)
        return out

    def run(self, x: torch.Tensor, grouping) -> torch.Tensor:
        """The feed-forward of every local expert on its rows: ``x`` in ``grouping``'s layout (``[R, h]`` sorted by
        expert, or ``[E_local, C, h]`` padded); projections through ``grouping.mm(x, weight [E_local, k, n])``,
        per-expert biases through ``grouping.bias``. Returns ``[R, h]`` / ``[E_local, C, h]``."""
        raise NotImplementedError


class StackedExperts(_GroupedExperts):
    """``E`` SwiGLU experts ``down(act(gate(x)) * up(x))`` in stacked weights (Mixtral, Qwen2-MoE)."""

    weight_names = ("gate_up_proj", "down_proj")
    etp_layouts = {"gate_up_proj": PackedSplit(1, (1, 1), axis="etp"), "down_proj": EvenSplit(2, axis="etp")}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, act: str = "silu"):
        super().__init__(num_experts)
        self.hidden_dim, self.intermediate_dim = hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = ACT2FN[act]

    def run(self, x: torch.Tensor, grouping) -> torch.Tensor:
        gate, up = grouping.mm(x, self.weight("gate_up_proj").transpose(1, 2)).chunk(2, dim=-1)  # [..., i]
        return grouping.mm(self.act_fn(gate) * up, self.weight("down_proj").transpose(1, 2))  # [..., h]


class StackedDenseExperts(_GroupedExperts):
    """``E`` T5-style experts ``wo(dropout(act(wi(x))))`` in stacked weights (Switch Transformers'
    ``SwitchTransformersDenseActDense`` per expert). The dropout acts on whole (not tensor-split) activations."""

    weight_names = ("wi", "wo")
    etp_layouts = {"wi": EvenSplit(1, axis="etp"), "wo": EvenSplit(2, axis="etp")}

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, act: str = "relu", dropout: float = 0.0):
        super().__init__(num_experts)
        self.wi = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.wo = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.act = ACT2FN[act]
        self.dropout = Dropout(dropout)

    def run(self, x: torch.Tensor, grouping) -> torch.Tensor:
        hidden = self.dropout(self.act(grouping.mm(x, self.weight("wi").transpose(1, 2))))  # [..., f]
        return grouping.mm(hidden, self.weight("wo").transpose(1, 2))  # [..., d]


class ExpertTensorSplit(GridBlock):
    """Stacked experts split over ``ep`` (``first``: dim 0) and each expert's feed-forward over ``etp``
    (``second``). The pieces differ over ep and etp; the ``tp / etp`` sub-groups of a tensor-parallel group hold the
    same pieces (gradient norms count them once)."""

    def num_replicas(self, context) -> int:
        return context.tp_size // self.second.position(context)[1]

    def dcp_view(self, local, context):
        return None  # no single Shard(dim) over one mesh axis: resumable checkpoints store the gathered tensor


class ExpertParallel(Style):
    """Plan style of stacked experts (``StackedExperts``, ``StackedDenseExperts``): split dim 0 (experts) over the
    expert-parallel group and, with ``expert_tensor_parallel_size > 1``, each expert's feed-forward over ``etp``."""

    hf_style = None  # not a tensor-parallel style (transformers lists it in base_model_ep_plan as "grouped_gemm")

    def build(self, module, context):
        module = module.shard(context.ep_group, context.etp_group)
        module.tp_group = context.tp_group
        # 2D / 2.5D: whole experts (ep = etp = 1, config.py refuses more) on whole tokens of this rank's batch block
        return grid_batch_replicated(module, context, "mixture-of-experts layers")

    def layouts(self, module):
        return module.expert_layouts()
