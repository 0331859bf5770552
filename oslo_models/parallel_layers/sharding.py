"""Sharding layouts: how one parameter is laid out over the ranks, as a small open class hierarchy.

A ``Layout`` answers, for a full tensor (the checkpoint's, layout-independent) and a group of ``size`` ranks:

- ``local_shape(full_shape, size)`` / ``full_shape(local_shape, size)``: this rank's shape, and back;
- ``read_shard(full_shape, read, rank, size)``: rank ``rank``'s piece, reading only what it owns through
  ``read(index)`` (``index`` a tuple of slices: a ``safetensors`` slice, a lazily read checkpoint, a full tensor);
- ``join(pieces)``: the full tensor from the pieces of ranks ``0 .. size-1`` (the exact inverse of
  ``read_shard``: padding stripped, packed blocks put back, replicated copies counted once);
- ``replicas(size)``: how many ranks hold each piece (1 unless whole heads are replicated);
- ``norm_share(local, p, context)``: this rank's ``sum |x|^p`` counted once over the ranks holding each entry
  (gradient-norm clipping; per block for packed q|k|v whose key/value heads alone are replicated).

The group is the layout's mesh ``axis`` (``"tp"``, a sub-axis of the 2D/2.5D/3D grid such as ``"tp_row"``, a tuple
of axes combined outermost first, or ``"ep"`` for stacked experts). The ``*_in`` / ``*_local`` methods read this
rank's position on that axis from a ``ParallelContext``; ``gather_local`` all-gathers the pieces and ``join``s
them. ``GridBlock`` composes two layouts over two axes (the ``q x q`` weight blocks of the grid modes); its rank
and size are pairs.

Layouts (``dim`` is the split tensor dim):

- ``Replicated()``: every rank holds the whole tensor.
- ``EvenSplit(dim)``: contiguous equal blocks; rank ``r`` holds rows ``r*n/size .. (r+1)*n/size``.
- ``InterleavedSplit(dim, period)``: ``dim`` interleaves ``period`` projections column by column (gpt-oss's
  ``gate_up_proj``: gate, up, gate, up, ...); an even split that never separates a gate column from its up column,
  so each rank's piece is interleaved the same way.
- ``PackedSplit(dim, sizes)``: ``dim`` packs blocks of relative sizes ``sizes`` (GPT-2's q|k|v ``(1, 1, 1)``;
  phi3's q|k|v under grouped-query attention ``(n, n_kv, n_kv)``); each block is split on its own, so rank ``r``
  holds its part of every block, in block order. ``heads=True``: ``sizes`` count heads, which are never cut and
  are replicated when there are fewer than ranks (``HeadSplit``'s rule, per block).
- ``VocabSplit(dim, vocab_size)``: a vocabulary padded with zero rows to a multiple of the group size; the padding
  exists only on the ranks, never in a checkpoint.
- ``HeadSplit(dim, num_heads)``: whole attention heads: ``num_heads/size`` per rank, or (``size > num_heads``)
  each head replicated on ``size/num_heads`` consecutive ranks (rank ``r`` holds head ``r // (size/num_heads)``).
- ``GridBlock(first, second)``: block ``(a, b)`` of ``first``'s dim over its axis and ``second``'s dim over its.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

import torch

from .mappings import _all_gather, group_size

Reader = Callable[[tuple], torch.Tensor]  # index (tuple of slices) -> tensor piece


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} = {numerator} is not divisible by tensor_parallel_size = {denominator}")
    return numerator // denominator


def padded_size(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


# ---------------------------------------------------------------------------------------------- mesh axes
@dataclass(frozen=True)
class AxisPosition:
    """This rank's index on a (possibly combined) mesh axis, and the axis size."""

    rank: int
    size: int


def axis_names(axis) -> tuple[str, ...]:
    return axis if isinstance(axis, tuple) else (axis,)


def axis_position(context, axis) -> AxisPosition:
    """Rank and size of a mesh axis, or of several combined (outermost first)."""
    rank, size = 0, 1
    for name in axis_names(axis):
        info = context.axis(name)
        rank, size = rank * info.size + info.rank, size * info.size
    return AxisPosition(rank, size)


def _pieces(local: torch.Tensor, context, axis, dim: int) -> list[torch.Tensor]:
    """Every rank's piece along ``axis`` (combined axes outermost first), all-gathered innermost axis first."""
    names = axis_names(axis)
    for name in reversed(names):
        local = _all_gather(local, context.axis(name).group, dim)
    return list(local.chunk(axis_position(context, axis).size, dim=dim))


def _with(index: tuple, dim: int, value: slice) -> tuple:
    out = list(index)
    out[dim] = value
    return tuple(out)


def _whole(shape) -> tuple:
    return tuple(slice(None) for _ in shape)


def _resized(shape, dim: int, size: int) -> tuple[int, ...]:
    return _with(tuple(shape), dim, size)


# ---------------------------------------------------------------------------------------------- the interface
class Layout:
    """How one parameter is laid out over the ranks of ``axis``; see the module docstring."""

    dim: int | None  # the split tensor dim (``None``: replicated)
    axis = "tp"

    # ---- over one group of ``size`` ranks
    def local_shape(self, full_shape: tuple[int, ...], size) -> tuple[int, ...]:
        raise NotImplementedError

    def full_shape(self, local_shape: tuple[int, ...], size) -> tuple[int, ...]:
        raise NotImplementedError

    def read_shard(self, full_shape: tuple[int, ...], read: Reader, rank, size) -> torch.Tensor:
        raise NotImplementedError

    def join(self, pieces: Sequence) -> torch.Tensor:
        raise NotImplementedError

    def replicas(self, size) -> int:
        return 1

    @property
    def split(self) -> bool:
        """Whether the ranks hold different pieces (``False``: replicated)."""
        return True

    def describe(self) -> str:
        """A hint for error messages about what the split dim holds ("" when nothing to say)."""
        return ""

    # ---- under a ParallelContext
    def position(self, context):
        """``(rank, size)`` of this rank on the layout's axis."""
        where = axis_position(context, self.axis)
        return where.rank, where.size

    def local_shape_in(self, full_shape: tuple[int, ...], context) -> tuple[int, ...]:
        """This rank's shape for a full tensor of ``full_shape`` under ``context``'s layout."""
        return tuple(self.local_shape(tuple(full_shape), self.position(context)[1]))

    def full_shape_of(self, local_shape: tuple[int, ...], context) -> tuple[int, ...]:
        """The full (checkpoint) shape a local piece of ``local_shape`` comes from."""
        return tuple(self.full_shape(tuple(local_shape), self.position(context)[1]))

    def read_local(self, full_shape: tuple[int, ...], read: Reader, context) -> torch.Tensor:
        """This rank's piece under ``context``."""
        rank, size = self.position(context)
        return self.read_shard(tuple(full_shape), read, rank, size)

    def gather(self, local: torch.Tensor, group) -> torch.Tensor:
        """The full tensor from every rank's piece, all-gathered over ``group`` (collective)."""
        return self.join(list(_all_gather(local, group, self.dim).chunk(group_size(group), dim=self.dim)))

    def gather_local(self, local: torch.Tensor, context) -> torch.Tensor:
        """The full tensor from every rank's piece, all-gathered over the layout's axes (collective)."""
        return self.join(_pieces(local, context, self.axis, self.dim))

    def num_replicas(self, context) -> int:
        """How many tensor-parallel ranks hold each piece (norms over the tensor-parallel group divide by it). A
        piece split over another axis (``"ep"``) is held by every tensor-parallel rank."""
        _, size = self.position(context)
        return self._tp_holders(context) * self.replicas(size)

    def _tp_holders(self, context) -> int:
        """Tensor-parallel ranks holding the same piece before any head replication."""
        _, size = self.position(context)
        split = size if all(name.startswith("tp") for name in axis_names(self.axis)) else 1
        return context.tp_size // split

    def norm_share(self, local: torch.Tensor, norm_type: float, context) -> torch.Tensor:
        """``sum |x|^p`` of this rank's piece (p = ``norm_type``, finite) divided by how many tensor-parallel ranks
        hold each of its entries, so that the sum over the tensor-parallel group counts every entry once
        (gradient-norm clipping)."""
        return torch.linalg.vector_norm(local, norm_type).pow(norm_type) / self.num_replicas(context)

    def dcp_view(self, local: torch.Tensor, context):
        """``(view, global_shape, shards)``: ``local`` as one box of a layout-independent global tensor, for
        resumable checkpoints. ``shards`` lists ``(dim, axis)`` pairs: along ``view``'s ``dim`` the box is this
        rank's ``Shard(dim)`` chunk over mesh ``axis`` (a name or a tuple of names combined outermost first;
        torch.chunk's uneven chunking); ``()`` when the piece is the whole tensor. ``None`` when no such box
        expresses the layout: the caller then stores the gathered tensor whole and reads its piece back with
        ``read_local``. The global shape never depends on the layout, so any layout reads any other's save."""
        _, size = self.position(context)
        full = self.full_shape(tuple(local.shape), size)
        return local, full, (((self.dim, self.axis),) if size > 1 else ())


@dataclass(frozen=True)
class Replicated(Layout):
    """Every rank holds the whole tensor."""

    dim = None

    def local_shape(self, full_shape, size):
        return tuple(full_shape)

    def full_shape(self, local_shape, size):
        return tuple(local_shape)

    def read_shard(self, full_shape, read, rank, size):
        return read(_whole(full_shape))

    def join(self, pieces):
        return pieces[0]

    @property
    def split(self) -> bool:
        return False

    def position(self, context):
        return 0, 1

    def gather(self, local, group):
        return local

    def gather_local(self, local, context):
        return local

    def num_replicas(self, context) -> int:
        return context.tp_size

    def dcp_view(self, local, context):
        return local, tuple(local.shape), ()


REPLICATED = Replicated()


@dataclass(frozen=True)
class EvenSplit(Layout):
    """``dim`` cut in ``size`` contiguous equal blocks: rank ``r`` holds block ``r``."""

    dim: int
    axis: str | tuple[str, ...] = "tp"

    def local_shape(self, full_shape, size):
        return _resized(full_shape, self.dim, divide(full_shape[self.dim], size, "split size"))

    def full_shape(self, local_shape, size):
        return _resized(local_shape, self.dim, local_shape[self.dim] * size)

    def read_shard(self, full_shape, read, rank, size):
        per_rank = self.local_shape(full_shape, size)[self.dim]
        if size == 1:
            return read(_whole(full_shape))
        return read(_with(_whole(full_shape), self.dim, slice(rank * per_rank, (rank + 1) * per_rank)))

    def join(self, pieces):
        return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), dim=self.dim)


@dataclass(frozen=True)
class InterleavedSplit(EvenSplit):
    """``dim`` interleaves ``period`` projections column by column (gpt-oss's fused ``gate_up_proj``: column
    ``2i`` is gate ``i``, column ``2i+1`` is up ``i``). Rank ``r`` holds a contiguous block of whole periods, so its
    piece interleaves its gate and up columns the same way (``piece[..., 0::2]`` is gate block ``r``). A split that
    would separate the columns of one period is refused."""

    period: int = 2

    def local_shape(self, full_shape, size):
        periods = divide(full_shape[self.dim], self.period, "interleaved size")
        return _resized(full_shape, self.dim, divide(periods, size, "interleaved pairs") * self.period)


@dataclass(frozen=True)
class VocabSplit(Layout):
    """A vocabulary of ``vocab_size`` rows along ``dim``, padded with zero rows to a multiple of the group size:
    rank ``r`` holds rows ``r*p .. (r+1)*p`` of the padded table (``p = padded/size``)."""

    dim: int
    vocab_size: int
    axis: str | tuple[str, ...] = "tp"

    def local_shape(self, full_shape, size):
        return _resized(full_shape, self.dim, padded_size(full_shape[self.dim], size) // size)

    def full_shape(self, local_shape, size):
        return _resized(local_shape, self.dim, self.vocab_size)

    def read_shard(self, full_shape, read, rank, size):
        dim, rows = self.dim, full_shape[self.dim]
        per_rank = padded_size(rows, size) // size
        start, stop = rank * per_rank, min((rank + 1) * per_rank, rows)
        whole = _whole(full_shape)
        piece = read(_with(whole, dim, slice(start, stop))) if stop > start else None
        num_pad = per_rank - max(0, stop - start)
        if num_pad == 0:
            return piece
        ref = piece if piece is not None else read(_with(whole, dim, slice(0, 1)))
        pad = torch.zeros(_resized(full_shape, dim, num_pad), dtype=ref.dtype)
        return pad if piece is None else torch.cat([piece, pad], dim=dim)

    def join(self, pieces):
        full = pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), dim=self.dim)
        return full.narrow(self.dim, 0, self.vocab_size)

    def dcp_view(self, local, context):
        _, full, shards = super().dcp_view(local, context)
        rank, _ = self.position(context)
        rows = local.shape[self.dim]
        real = max(0, min(rows, self.vocab_size - rank * rows))  # the padding rows are never stored
        return local.narrow(self.dim, 0, real), full, shards


@dataclass(frozen=True)
class HeadSplit(Layout):
    """``dim`` holds ``num_heads`` equal heads, never cut: ``num_heads/size`` whole heads per rank, or at
    ``size > num_heads`` each head replicated on ``size/num_heads`` consecutive ranks (Megatron's rule for
    grouped-query key/value heads). ``join`` keeps one copy of each head."""

    dim: int
    num_heads: int
    axis: str | tuple[str, ...] = "tp"

    def replicas(self, size) -> int:
        if size <= self.num_heads:
            return 1
        if size % self.num_heads:
            raise ValueError(f"tensor_parallel_size = {size} is not a multiple of the {self.num_heads} key/value "
                             "heads it must replicate")
        return size // self.num_heads

    def _rows_per_rank(self, rows: int, size: int) -> int:
        if rows % self.num_heads:
            raise ValueError(f"split size {rows} does not hold {self.num_heads} equal heads")
        if size > self.num_heads:
            self.replicas(size)  # raises when the heads cannot be replicated evenly
            heads = 1
        else:
            heads = divide(self.num_heads, size, "number of key/value heads")
        return heads * (rows // self.num_heads)

    def local_shape(self, full_shape, size):
        return _resized(full_shape, self.dim, self._rows_per_rank(full_shape[self.dim], size))

    def full_shape(self, local_shape, size):
        return _resized(local_shape, self.dim, local_shape[self.dim] * size // self.replicas(size))

    def read_shard(self, full_shape, read, rank, size):
        per_rank = self._rows_per_rank(full_shape[self.dim], size)
        start = rank // self.replicas(size) * per_rank
        return read(_with(_whole(full_shape), self.dim, slice(start, start + per_rank)))

    def join(self, pieces):
        kept = list(pieces)[::self.replicas(len(pieces))]
        return kept[0] if len(kept) == 1 else torch.cat(kept, dim=self.dim)

    def dcp_view(self, local, context):
        return None if self.replicas(self.position(context)[1]) > 1 else super().dcp_view(local, context)


@dataclass(frozen=True)
class PackedSplit(Layout):
    """``dim`` packs blocks of relative sizes ``sizes`` one after the other (q|k|v); each block is split on its
    own, evenly (``EvenSplit``) or, with ``heads=True`` (``sizes`` then count heads), by whole heads
    (``HeadSplit``: replicated when fewer than the ranks). Rank ``r``'s piece is its part of every block, in block
    order: for phi3's ``qkv_proj`` (``sizes=(n, n_kv, n_kv)``) that is query heads ``r*n/size ..`` and the
    key/value heads they use."""

    dim: int
    sizes: tuple[int, ...]
    heads: bool = False
    axis: str | tuple[str, ...] = "tp"

    def _block_layout(self, i: int) -> Layout:
        return HeadSplit(self.dim, self.sizes[i]) if self.heads else EvenSplit(self.dim)

    def _weights(self, size: int) -> list[Fraction]:
        """Block ``i``'s local rows per full row of one size unit: ``sizes[i]/size``, or with heads
        ``sizes[i]/min(size, sizes[i])`` (a rank holds at least one whole head)."""
        return [Fraction(s, min(size, s) if self.heads else size) for s in self.sizes]

    def _full_blocks(self, rows: int) -> list[int]:
        total = sum(self.sizes)
        if rows % total:
            raise ValueError(f"packed size = {rows} does not hold blocks of relative sizes {self.sizes}")
        return [rows // total * s for s in self.sizes]

    def _local_blocks(self, rows: int, size: int) -> list[int]:
        weights = self._weights(size)
        unit = Fraction(rows) / sum(weights)
        blocks = [unit * w for w in weights]
        if any(b.denominator != 1 for b in blocks):
            raise ValueError(f"a local piece of {rows} rows does not hold blocks {self.sizes} split {size} ways")
        return [int(b) for b in blocks]

    def local_shape(self, full_shape, size):
        rows = sum(self._block_layout(i).local_shape(_resized(full_shape, self.dim, block), size)[self.dim]
                   for i, block in enumerate(self._full_blocks(full_shape[self.dim])))
        return _resized(full_shape, self.dim, rows)

    def full_shape(self, local_shape, size):
        weights = self._weights(size)
        rows = Fraction(local_shape[self.dim]) / sum(weights) * sum(self.sizes)
        return _resized(local_shape, self.dim, int(rows))

    def block_replicas(self, size) -> list[int]:
        """How many ranks hold each block's piece (``> 1`` only for heads fewer than the ranks)."""
        return [self._block_layout(i).replicas(size) for i in range(len(self.sizes))]

    def replicas(self, size) -> int:
        counts = set(self.block_replicas(size))
        if len(counts) > 1:
            raise NotImplementedError(f"packed blocks {self.sizes} replicated unequally over {size} ranks have no "
                                      "single replica count (norm_share weighs each block; clipping a ZeRO-3 shard "
                                      "of such a parameter is not implemented)")
        return counts.pop()

    def norm_share(self, local, norm_type, context):
        """Per block: its ``sum |x|^p`` over the ranks holding that block's piece (q heads once, replicated
        key/value heads on ``tp/n_kv`` ranks)."""
        _, size = self.position(context)
        replicas = self.block_replicas(size)
        if len(set(replicas)) == 1:
            return super().norm_share(local, norm_type, context)
        pieces = local.split(self._local_blocks(local.shape[self.dim], size), dim=self.dim)
        holders = self._tp_holders(context)
        return sum(torch.linalg.vector_norm(piece, norm_type).pow(norm_type) / (holders * count)
                   for piece, count in zip(pieces, replicas))

    def read_shard(self, full_shape, read, rank, size):
        pieces, offset = [], 0
        for i, block in enumerate(self._full_blocks(full_shape[self.dim])):
            def read_block(index, offset=offset, block=block):
                start, stop, _ = index[self.dim].indices(block)
                return read(_with(index, self.dim, slice(offset + start, offset + stop)))

            pieces.append(self._block_layout(i).read_shard(_resized(full_shape, self.dim, block), read_block, rank,
                                                           size))
            offset += block
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def join(self, pieces):
        blocks = self._local_blocks(pieces[0].shape[self.dim], len(pieces))
        parts = [list(piece.split(blocks, dim=self.dim)) for piece in pieces]
        joined = [self._block_layout(i).join([part[i] for part in parts]) for i in range(len(blocks))]
        return torch.cat(joined, dim=self.dim)

    def describe(self) -> str:
        return f" (it packs {len(self.sizes)} blocks of relative sizes {self.sizes}, e.g. q|k|v, along dim {self.dim})"

    def dcp_view(self, local, context):
        _, size = self.position(context)
        if len(set(self.sizes)) > 1 or self.replicas(size) > 1:
            return None  # unequal or replicated blocks: stored whole
        _, _, shards = super().dcp_view(local, context)
        dim, n = self.dim, len(self.sizes)
        shape = list(local.shape)
        packed = shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:]
        full = packed[:dim + 1] + [packed[dim + 1] * size] + packed[dim + 2:]
        return local.view(packed), tuple(full), tuple((dim + 1, axis) for _, axis in shards)


@dataclass(frozen=True)
class GridBlock(Layout):
    """Block ``(a, b)`` of a tensor split along ``first.dim`` over ``first.axis`` (rank ``a``) and along
    ``second.dim`` over ``second.axis`` (rank ``b``): the ``q x q`` weight blocks of the 2D / 2.5D / 3D modes.
    Rank and size are pairs ``(a, b)``; ``join`` takes the pieces nested ``pieces[a][b]``."""

    first: Layout
    second: Layout

    @property
    def dim(self):
        return self.first.dim

    @property
    def axis(self):
        return self.first.axis

    @property
    def dim2(self):
        return self.second.dim

    @property
    def axis2(self):
        return self.second.axis

    def position(self, context):
        (a, n), (b, m) = self.first.position(context), self.second.position(context)
        return (a, b), (n, m)

    def local_shape(self, full_shape, size):
        return self.second.local_shape(self.first.local_shape(full_shape, size[0]), size[1])

    def full_shape(self, local_shape, size):
        return self.second.full_shape(self.first.full_shape(local_shape, size[0]), size[1])

    def replicas(self, size) -> int:
        return self.first.replicas(size[0]) * self.second.replicas(size[1])

    def read_shard(self, full_shape, read, rank, size):
        dim2 = self.second.dim

        def read_first(index: tuple) -> torch.Tensor:
            return self.second.read_shard(full_shape, lambda index2: read(_with(index, dim2, index2[dim2])),
                                          rank[1], size[1])

        narrowed = self.second.local_shape(full_shape, size[1])  # the shape of any zero padding
        return self.first.read_shard(narrowed, read_first, rank[0], size[0])

    def join(self, pieces):
        return self.first.join([self.second.join(row) for row in pieces])

    def gather(self, local, group):
        raise TypeError("a GridBlock spans two groups: use gather_local(local, context)")

    def gather_local(self, local, context):
        rows = self.second.join(_pieces(local, context, self.second.axis, self.second.dim))
        return self.first.join(_pieces(rows, context, self.first.axis, self.first.dim))

    def num_replicas(self, context) -> int:
        (_, n), (_, m) = self.first.position(context), self.second.position(context)
        return context.tp_size // (n * m) * self.first.replicas(n)

    def dcp_view(self, local, context):
        """The two layouts' boxes composed: the one with the higher dim views ``local`` first (a packed view
        inserts a dim at its own dim, which moves only higher dims), then the other views the result, so each
        canonical shape is the one its one-axis layout stores (a grid save loads at 1D and back). ``None`` when
        either needs the whole tensor (replicated heads)."""
        high, low = sorted((self.first, self.second), key=lambda layout: layout.dim, reverse=True)
        if high.dim == low.dim:
            return None
        first = high.dcp_view(local, context)
        if first is None:
            return None
        view, high_full, high_shards = first
        second = low.dcp_view(view, context)
        if second is None:
            return None
        box, full, low_shards = second
        inserted = box.dim() - view.dim()  # dims the low layout's view added at its dim
        full = list(full)
        for dim in range(low.dim + 1, len(high_full)):
            full[dim + inserted] = high_full[dim]  # the high layout's global sizes, moved past the inserted dims
        return box, tuple(full), low_shards + tuple((dim + inserted, axis) for dim, axis in high_shards)


# ---------------------------------------------------------------------------------------------- constructors
def split_layout(dim: int | None, *, num_packed: int = 1, vocab_size: int | None = None,
                 num_heads: int | None = None, axis="tp") -> Layout:
    """The one-dim layout of a column-parallel output (or any split dim): a padded vocabulary, ``num_packed`` equal
    packed blocks, whole heads, or an even split."""
    if dim is None:
        return REPLICATED
    if num_heads is not None:
        return HeadSplit(dim, num_heads, axis)
    if vocab_size is not None:
        return VocabSplit(dim, vocab_size, axis)
    if num_packed > 1:
        return PackedSplit(dim, (1,) * num_packed, axis=axis)
    return EvenSplit(dim, axis)
