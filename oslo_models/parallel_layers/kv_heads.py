"""Grouped-query attention's key/value projections under tensor parallelism, including ``tp > num_key_value_heads``.

Query heads are split over the tensor-parallel ranks like any column-parallel output. Key/value heads are fewer
(GQA: ``n_kv < n``), and a rank's query heads must find their key/value head on the same rank:

- ``tp <= n_kv`` (``n_kv % tp == 0``): each rank holds ``n_kv/tp`` whole key/value heads: a plain column split;
- ``tp > n_kv`` (``tp % n_kv == 0``): each key/value head is *replicated* on ``tp/n_kv`` consecutive ranks; rank
  ``r`` holds head ``r // (tp/n_kv)``, which is exactly the head its ``n/tp`` query heads use (Megatron's rule).

A replicated copy receives gradient only from its own rank's query heads, so the weight (and bias) gradients of
the copies are summed over the ranks that share a head (the *replica group*, ``tp/n_kv`` consecutive TP ranks):
every copy then holds the full gradient and, with the same optimizer, the copies stay identical. The input
gradient needs nothing extra: the usual all-reduce over the whole TP group already sums every query head's part.

The layout for loading/saving is ``HeadSplit(dim, n_kv)``: a checkpoint saved from any tp holds exactly
the original ``[n_kv * head_dim, hidden]`` tensors.

Under the 2D / 2.5D / 3D modes a key/value projection is a column-parallel grid linear (``Linear2D`` /
``Linear3D``): ``n_kv/q`` whole heads per hidden block, which needs ``q | n_kv`` (``check_grid_heads``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import Linear, linear_forward
from .mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, group_size
from .plan import Style, _weight_out_dim
from .sharding import HeadSplit
from .tensor_parallel import ColumnParallelLinear


def check_grid_heads(num_heads: int, parallel, what: str = "num_attention_heads") -> None:
    """Under the 2D / 2.5D / 3D modes the heads follow the ``q`` hidden blocks of the grid (``q = grid_shape[-1]``):
    ``ValueError`` unless ``q`` divides ``num_heads``. Key/value heads fewer than ``q`` cannot be replicated as at
    1D: the grid's column blocks are fixed by the weight layout, not chosen per head."""
    if parallel.tensor_parallel_mode == "1d":
        return
    q = parallel.grid_shape[-1]
    if num_heads % q:
        raise ValueError(f"tensor_parallel_mode={parallel.tensor_parallel_mode!r} splits the heads into q={q} "
                         f"blocks (grid {parallel.grid_shape}), but {what}={num_heads} is not divisible by {q}; use a "
                         "smaller grid or tensor_parallel_mode='1d' (which replicates key/value heads)")


class HeadsLinear(Linear):
    """A plain ``Linear`` whose output is ``num_heads`` heads of equal size (GQA ``k_proj``/``v_proj``); it computes
    exactly ``Linear`` and only tells the plan how its output may be split."""

    def __init__(self, in_features: int, out_features: int, *, num_heads: int, **kwargs):
        if out_features % num_heads:
            raise ValueError(f"out_features={out_features} is not {num_heads} equal heads")
        self.num_heads = num_heads
        super().__init__(in_features, out_features, **kwargs)


class KVHeadColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel ``HeadsLinear``: output ``[b, s, max(n_kv/tp, 1) * head_dim]`` (this rank's key/value heads).

    Forward collectives: those of ``ColumnParallelLinear`` (none, or the sequence all-gather). Backward: theirs
    (all-reduce / reduce-scatter of the input gradient over TP) plus, when heads are replicated, an all-reduce of
    the weight and bias gradients over the replica group (``replica_group``).
    """

    def __init__(self, in_features: int, out_features: int, *, num_heads: int, group, replica_group,
                 bias: bool = True, layout: str = "linear", device=None, dtype=None):
        spec = HeadSplit(0, num_heads)
        tp = group_size(group)
        self.num_heads, self.replicas = num_heads, spec.replicas(tp)
        local = spec.local_shape((out_features,), tp)[0]
        # Build as a column split of a virtual ``local * tp`` output, then keep the real geometry.
        super().__init__(in_features, local * tp, group=group, bias=bias, layout=layout, device=device, dtype=dtype)
        self.full_out_features = out_features
        self.replica_group = replica_group if self.replicas > 1 else None

    @classmethod
    def from_plain(cls, module: HeadsLinear, group, *, replica_group=None) -> "KVHeadColumnParallelLinear":
        return cls(module.in_features, module.out_features, num_heads=module.num_heads, group=group,
                   replica_group=replica_group, bias=module.bias is not None,
                   layout=getattr(module, "layout", "linear"), device=module.weight.device,
                   dtype=module.weight.dtype)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        if self.replica_group is None:
            return super().forward(x, sequence_parallel=sequence_parallel)
        if self.sequence_parallel_active(sequence_parallel):
            x = gather_from_sequence_parallel_region(x, self.group, grad_is_partial=True)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        weight = copy_to_tensor_parallel_region(self.weight, self.replica_group)  # backward: sum the copies
        bias = copy_to_tensor_parallel_region(self.bias, self.replica_group) if self.bias is not None else None
        return linear_forward(x, weight, bias, self.layout)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("key/value head outputs are consumed on their rank; they are never gathered")


@dataclass(frozen=True)
class KVHeadColwise(Style):
    """Plan style of a GQA key/value projection (a ``HeadsLinear``): see the module docstring."""

    hf_style = "colwise"
    # 2D / 2.5D / 3D: a column-parallel linear of the grid, whose output is split over the q hidden blocks; heads
    # are never cut and never replicated there (``check_grid_heads``).
    grid_layer = "colwise"

    def build(self, module, context):
        if context.is_grid:
            check_grid_heads(module.num_heads, context.config, "num_key_value_heads")
        return super().build(module, context)

    def build_1d(self, module, context):
        replicas = HeadSplit(0, module.num_heads).replicas(context.tp_size)
        replica_group = context.tp_subgroup(replicas) if replicas > 1 else None
        return KVHeadColumnParallelLinear.from_plain(module, context.tp_group, replica_group=replica_group)

    def layouts(self, module):
        specs = {"weight": HeadSplit(_weight_out_dim(module), module.num_heads)}
        if getattr(module, "bias", None) is not None:
            specs["bias"] = HeadSplit(0, module.num_heads)
        return specs
