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

A fused q|k|v projection of grouped-query attention (Phi-3's ``qkv_proj``: ``[(n + 2 n_kv) * d, h]``, blocks of
unequal size) is a ``PackedHeadsLinear``; its column-parallel form ``PackedKVHeadColumnParallelLinear`` holds this
rank's ``n/tp`` query heads and its key/value heads (``max(n_kv/tp, 1)`` each, replicated as above) from each
block, in block order: layout ``PackedSplit(0, (n, n_kv, n_kv), heads=True)``. Only the replicated blocks'
gradients are summed over their replica group. 1D only (the grid layers split packed outputs into equal blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import Linear, linear_forward
from .mappings import copy_to_tensor_parallel_region, group_size
from .plan import Style, _weight_out_dim, refuse_grid_mode
from .sharding import HeadSplit, PackedSplit
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
        x = self.enter_tensor_parallel(x, sequence_parallel)
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


# ---------------------------------------------------------------------------------------------- packed q|k|v
class PackedHeadsLinear(Linear):
    """A plain ``Linear`` whose output packs blocks of whole heads one after the other: ``head_counts`` heads of
    ``head_dim`` each (Phi-3's ``qkv_proj``: ``(n, n_kv, n_kv)``). It computes exactly ``Linear``; ``blocks`` are the
    output sizes of the blocks, what a caller splits the output by."""

    def __init__(self, in_features: int, *, head_counts: tuple[int, ...], head_dim: int, **kwargs):
        self.head_counts, self.head_dim = tuple(head_counts), head_dim
        super().__init__(in_features, sum(self.head_counts) * head_dim, **kwargs)

    @property
    def blocks(self) -> list[int]:
        return [count * self.head_dim for count in self.head_counts]


class PackedKVHeadColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel ``PackedHeadsLinear``: output ``[b, s, sum(blocks)]`` with ``blocks`` this rank's part of
    each packed block (``n/tp`` query heads, then ``max(n_kv/tp, 1)`` key and value heads).

    Forward collectives: those of ``ColumnParallelLinear`` (none, or the sequence all-gather). Backward: theirs
    (all-reduce / reduce-scatter of the input gradient over TP) plus, for each block whose heads are replicated
    (``tp > n_kv``), an all-reduce of that block's weight and bias gradient rows over its replica group: a copy sees
    only its rank's query heads, the sum is the full gradient, and the copies stay equal under the same optimizer.
    """

    def __init__(self, in_features: int, *, head_counts: tuple[int, ...], head_dim: int, group, replica_groups,
                 bias: bool = True, device=None, dtype=None):
        tp = group_size(group)
        self.head_counts, self.head_dim = tuple(head_counts), head_dim
        self.blocks = [HeadSplit(0, count).local_shape((count * head_dim,), tp)[0] for count in self.head_counts]
        # built as a column split of a virtual ``local * tp`` output, then the real geometry is kept
        super().__init__(in_features, sum(self.blocks) * tp, group=group, bias=bias, device=device, dtype=dtype)
        self.full_out_features = sum(self.head_counts) * head_dim
        self.replica_groups = list(replica_groups)

    @classmethod
    def from_plain(cls, module: PackedHeadsLinear, group, *, replica_groups) -> "PackedKVHeadColumnParallelLinear":
        return cls(module.in_features, head_counts=module.head_counts, head_dim=module.head_dim, group=group,
                   replica_groups=replica_groups, bias=module.bias is not None, device=module.weight.device,
                   dtype=module.weight.dtype)

    def _summed_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (weight or bias, blocks along dim 0) whose replicated blocks' gradients are summed over their
        replica groups in the backward (forward: identity)."""
        pieces = tensor.split(self.blocks, dim=0)
        return torch.cat([piece if replicas is None else copy_to_tensor_parallel_region(piece, replicas)
                          for piece, replicas in zip(pieces, self.replica_groups)], dim=0)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        if all(replicas is None for replicas in self.replica_groups):
            return super().forward(x, sequence_parallel=sequence_parallel)
        x = self.enter_tensor_parallel(x, sequence_parallel)
        bias = self._summed_over_replicas(self.bias) if self.bias is not None else None
        return linear_forward(x, self._summed_over_replicas(self.weight), bias, self.layout)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("packed q|k|v head outputs are consumed on their rank; they are never gathered")


@dataclass(frozen=True)
class PackedKVHeadColwise(Style):
    """Plan style of a fused grouped-query q|k|v projection (a ``PackedHeadsLinear``): see the module docstring.
    Not published: ``transformers``' vocabulary has no style for unequal packed blocks (its own Phi-3 plan gathers
    the output instead)."""

    hf_style = None

    def build(self, module, context):
        refuse_grid_mode(context, "a packed q|k|v projection of unequal blocks (grouped-query attention)")
        if module.layout != "linear":
            raise ValueError("PackedKVHeadColwise takes a [out, in] (linear layout) weight")
        replicas = self.layouts(module)["weight"].block_replicas(context.tp_size)
        groups = [context.tp_subgroup(count) if count > 1 else None for count in replicas]
        return PackedKVHeadColumnParallelLinear.from_plain(module, context.tp_group, replica_groups=groups)

    def layouts(self, module):
        layout = PackedSplit(0, tuple(module.head_counts), heads=True)
        return {"weight": layout, **({"bias": layout} if getattr(module, "bias", None) is not None else {})}
