"""A fused query|key|value projection whose output is ``groups`` groups of heads, each ``[q_1 .. q_G, k, v]`` (``G``
query heads sharing one key and one value head), under tensor parallelism. It covers every fused layout of Bloom and
Falcon (``query_key_value``):

- Bloom, Falcon with ``multi_query=False``: per head ``[q, k, v]``: ``groups = n``, ``G = 1``;
- Falcon's multi-query attention: ``[q_1 .. q_n, k, v]``: one group, ``G = n``;
- Falcon's ``new_decoder_architecture``: per key/value head ``[q_1 .. q_G, k, v]``: ``groups = n_kv``, ``G = n/n_kv``.

A rank must hold query heads together with the key/value head they use (a column split of the fused output would
hand rank 0 the query heads and rank 1 the keys):

- ``tp <= groups`` (``tp | groups``): each rank holds ``groups/tp`` whole groups, a contiguous block of rows;
- ``tp > groups`` (``tp % groups == 0``, ``(tp/groups) | G``): each group is cut over ``R = tp/groups`` consecutive
  ranks: rank ``r`` holds group ``r // R``'s query heads ``(r % R)*G/R ..`` and a copy of its key and value head
  (Megatron's replication of few key/value heads; ``PackedSplit(heads=True)`` within the group).

Either way rank ``r``'s query heads are ``r*n/tp .. (r+1)*n/tp - 1`` (as ``Colwise`` splits ``q_proj``, so per-head
data such as ALiBi slopes is sliced the same way) and its local output ``[b, s, g_local*(G_local+2)*d]`` has the
full layout's structure with ``g_local`` groups of ``G_local`` query heads (``local_groups``, ``local_q_per_group``).

Collectives: those of ``ColumnParallelLinear`` (forward none, or the sequence all-gather under sequence parallelism;
backward the all-reduce / reduce-scatter of the input gradient); with ``tp > groups`` also the all-reduce of the
key/value rows' weight and bias gradients over the ranks holding copies of the group (``replica_group``), so the
copies stay equal. Linear weight layout ``[out, in]`` only; 1D tensor parallelism only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import Linear, linear_forward
from .mappings import copy_to_tensor_parallel_region, group_size
from .plan import Style, refuse_grid_mode
from .sharding import EvenSplit, Layout, PackedSplit, _resized, _with, divide
from .tensor_parallel import ColumnParallelLinear


@dataclass(frozen=True)
class GroupedQKVSplit(Layout):
    """Layout of a fused ``[groups x (G q | k | v)]`` dim (see the module docstring); ``sizes`` = ``(G, 1, 1)``
    heads. ``replicas``: 1 while ``size <= groups``; beyond, the query rows are split and the key/value rows
    replicated, which no single count describes (``replica_parts`` gives the count of each part)."""

    dim: int
    groups: int
    sizes: tuple[int, ...]
    axis: str | tuple[str, ...] = "tp"

    def _ranks_per_group(self, size: int) -> int:
        """1 when whole groups are split (``size <= groups``); else the ranks ``R`` sharing each group."""
        if size <= self.groups:
            divide(self.groups, size, "number of query/key/value head groups")
            return 1
        if size % self.groups:
            raise ValueError(f"tensor_parallel_size = {size} exceeds the {self.groups} query/key/value head groups "
                             "but is not a multiple of it, so their key/value heads cannot be replicated evenly")
        return size // self.groups

    def _inner(self) -> PackedSplit:
        return PackedSplit(self.dim, self.sizes, heads=True)

    def _group_rows(self, rows: int) -> int:
        if rows % (self.groups * sum(self.sizes)):
            raise ValueError(f"fused size {rows} does not hold {self.groups} groups of {self.sizes} heads")
        return rows // self.groups

    def local_shape(self, full_shape, size):
        ranks = self._ranks_per_group(size)
        if ranks == 1:
            return EvenSplit(self.dim).local_shape(full_shape, size)
        group = _resized(full_shape, self.dim, self._group_rows(full_shape[self.dim]))
        return self._inner().local_shape(group, ranks)

    def full_shape(self, local_shape, size):
        ranks = self._ranks_per_group(size)
        if ranks == 1:
            return _resized(local_shape, self.dim, local_shape[self.dim] * size)
        group = self._inner().full_shape(local_shape, ranks)
        return _resized(local_shape, self.dim, group[self.dim] * self.groups)

    def read_shard(self, full_shape, read, rank, size):
        ranks = self._ranks_per_group(size)
        if ranks == 1:
            return EvenSplit(self.dim).read_shard(full_shape, read, rank, size)
        rows = self._group_rows(full_shape[self.dim])
        offset = rank // ranks * rows

        def read_group(index):
            start, stop, _ = index[self.dim].indices(rows)
            return read(_with(index, self.dim, slice(offset + start, offset + stop)))

        return self._inner().read_shard(_resized(full_shape, self.dim, rows), read_group, rank % ranks, ranks)

    def join(self, pieces):
        pieces = list(pieces)
        ranks = self._ranks_per_group(len(pieces))
        if ranks > 1:
            pieces = [self._inner().join(pieces[g * ranks:(g + 1) * ranks]) for g in range(self.groups)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def replicas(self, size) -> int:
        ranks = self._ranks_per_group(size)
        return 1 if ranks == 1 else self._inner().replicas(ranks)

    def replica_parts(self, local: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
        """``[(part of this rank's piece, how many ranks hold it)]``: the whole piece once while groups are split
        whole; beyond, the query rows (held once) and the key/value rows (held by ``R`` ranks). Gradient-norm
        clipping counts each part once with it."""
        ranks = self._ranks_per_group(size)
        if ranks == 1:
            return [(local, 1)]
        head_dim = local.shape[self.dim] // (self.sizes[0] // ranks + sum(self.sizes[1:]))
        key_value = head_dim * sum(self.sizes[1:])
        query, kv = local.split([local.shape[self.dim] - key_value, key_value], dim=self.dim)
        return [(query, 1), (kv, ranks)]

    def norm_share(self, local, norm_type, context):
        """Each part's ``sum |x|^p`` divided by how many ranks hold it (``replica_parts``)."""
        _, size = self.position(context)
        return sum(torch.linalg.vector_norm(part, norm_type).pow(norm_type) / count
                   for part, count in self.replica_parts(local, size))

    def describe(self) -> str:
        return (f" (it packs {self.groups} groups of {self.sizes[0]} query heads, a key and a value head, along dim "
                f"{self.dim})")

    def dcp_view(self, local, context):
        _, size = self.position(context)
        return super().dcp_view(local, context) if self._ranks_per_group(size) == 1 else None


class GroupedQKVLinear(Linear):
    """A plain ``Linear`` ``hidden -> groups*(G+2)*head_dim`` whose output is grouped heads ``[q_1..q_G, k, v]``;
    it computes exactly ``Linear`` and tells the plan and the attention how its output is laid out."""

    def __init__(self, in_features: int, *, num_groups: int, q_per_group: int, head_dim: int, bias: bool = True,
                 device=None, dtype=None):
        self.num_groups, self.q_per_group, self.head_dim = num_groups, q_per_group, head_dim
        super().__init__(in_features, num_groups * (q_per_group + 2) * head_dim, bias=bias, device=device,
                         dtype=dtype)
        self.local_groups, self.local_q_per_group = num_groups, q_per_group

    def layout_split(self) -> GroupedQKVSplit:
        return GroupedQKVSplit(0, self.num_groups, (self.q_per_group, 1, 1))


class GroupedQKVColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel ``GroupedQKVLinear``: output ``[b, s, g_local*(G_local+2)*d]``, this rank's groups (see the
    module docstring for the split and the collectives)."""

    def __init__(self, in_features: int, *, num_groups: int, q_per_group: int, head_dim: int, group, replica_group,
                 bias: bool = True, device=None, dtype=None):
        self.num_groups, self.q_per_group, self.head_dim = num_groups, q_per_group, head_dim
        split = GroupedQKVSplit(0, num_groups, (q_per_group, 1, 1))
        tp = group_size(group)
        out_features = num_groups * (q_per_group + 2) * head_dim
        local = split.local_shape((out_features,), tp)[0]
        # Built as a column split of a virtual ``local * tp`` output, then the real geometry is kept.
        super().__init__(in_features, local * tp, group=group, bias=bias, device=device, dtype=dtype)
        self.full_out_features = out_features
        ranks = split._ranks_per_group(tp)
        self.local_groups = num_groups // tp if ranks == 1 else 1
        self.local_q_per_group = q_per_group // ranks
        self.replica_group = replica_group if ranks > 1 else None

    @classmethod
    def from_plain(cls, module: GroupedQKVLinear, group, *, replica_group=None) -> "GroupedQKVColumnParallelLinear":
        return cls(module.in_features, num_groups=module.num_groups, q_per_group=module.q_per_group,
                   head_dim=module.head_dim, group=group, replica_group=replica_group, bias=module.bias is not None,
                   device=module.weight.device, dtype=module.weight.dtype)

    def _with_summed_copies(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor`` (weight or bias, rows ``[q.., k, v]``) whose key/value rows' gradient is summed over the
        replica group (identity forward)."""
        if tensor is None:
            return None
        query, key_value = tensor.split([tensor.shape[0] - 2 * self.head_dim, 2 * self.head_dim])
        return torch.cat([query, copy_to_tensor_parallel_region(key_value, self.replica_group)])

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        if self.replica_group is None:
            return super().forward(x, sequence_parallel=sequence_parallel)
        x = self.enter_tensor_parallel(x, sequence_parallel)
        return linear_forward(x, self._with_summed_copies(self.weight), self._with_summed_copies(self.bias),
                              self.layout)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("grouped query/key/value outputs are consumed on their rank; they are never "
                                  "gathered")


@dataclass(frozen=True)
class GroupedQKVColwise(Style):
    """Plan style of a ``GroupedQKVLinear`` (see the module docstring). Not published: ``transformers``' plans have
    no style for it. 1D only (the grid modes' column blocks would cut through the groups)."""

    hf_style = None

    def build(self, module, context):
        refuse_grid_mode(context, "a fused query_key_value of grouped heads (Bloom, Falcon)")
        ranks = module.layout_split()._ranks_per_group(context.tp_size)
        replica_group = context.tp_subgroup(ranks) if ranks > 1 else None
        return GroupedQKVColumnParallelLinear.from_plain(module, context.tp_group, replica_group=replica_group)

    def layouts(self, module):
        split = GroupedQKVSplit(0, module.num_groups, (module.q_per_group, 1, 1))
        return {"weight": split, **({"bias": split} if getattr(module, "bias", None) is not None else {})}
