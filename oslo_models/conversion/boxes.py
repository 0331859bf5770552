"""Where a rank's piece of a parameter lies in the full tensor: boxes, derived from the layout's own ``read_shard``.

A sharding ``Layout`` (``parallel_layers/sharding.py``) says how the loader reads rank ``r``'s piece out of the full
tensor (``read_shard``). The saver needs the inverse: for each element of the local piece, its place in the full
tensor, so that a rank can write its piece straight into a Hub file with nothing gathered. Every layout here splits
one tensor dim (two for a ``GridBlock``: each of its layouts touches only its own dim), so the map is *separable*:
per split dim, a list ``coords`` with ``coords[i]`` = the full index of local index ``i`` (``-1`` for padding rows
that exist only on the ranks, e.g. a padded vocabulary). It is found by running ``read_shard`` on a probe: the full
shape reduced to 1 on every other dim, filled along the split dim with ``index + 1`` (``0`` marks the zero padding
``read_shard`` adds). Cost: a few integers per row of the split dim; nothing of the tensor is read or copied. Packed
q|k|v blocks, whole heads (replicated ones included: several ranks then own the same box, the writer keeps one),
grouped heads, interleaved gate/up columns and the padded vocabulary are all found this way, with no code per layout.

A ``Box`` is ``(local_start, full_start, length)`` per dim: ``local[local_start:+length]`` (each dim) is
``full[full_start:+length]``. ``flat_runs`` turns a box of a row-major tensor into contiguous runs of elements (what
a file write needs). All of this is local: no collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..parallel_layers.sharding import GridBlock, Layout


@dataclass(frozen=True)
class Box:
    """``local[local_start[d]:+length[d]] == full[full_start[d]:+length[d]]`` for every dim ``d``."""

    local_start: tuple[int, ...]
    full_start: tuple[int, ...]
    length: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.length, dtype=np.int64))

    def local_index(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.local_start, self.length))


def _dim_layouts(layout: Layout, rank, size) -> list[tuple[int, Layout, int, int]]:
    """``[(dim, one-dim layout, rank, size)]``: a ``GridBlock`` is its two layouts, each over its own axis."""
    if isinstance(layout, GridBlock):
        return (_dim_layouts(layout.first, rank[0], size[0]) + _dim_layouts(layout.second, rank[1], size[1]))
    if layout.dim is None or not layout.split or size == 1:
        return []
    return [(layout.dim, layout, rank, size)]


def dim_coords(layout: Layout, full_shape: Sequence[int], rank: int, size: int) -> np.ndarray:
    """Full index of each local index along ``layout.dim`` (``-1``: padding), from ``layout.read_shard``."""
    dim = layout.dim
    probe_shape = [1] * len(full_shape)
    probe_shape[dim] = full_shape[dim]
    base = (torch.arange(full_shape[dim], dtype=torch.int64) + 1).view(probe_shape)
    piece = layout.read_shard(tuple(probe_shape), lambda index: base[index], rank, size)
    return piece.reshape(-1).numpy() - 1


def _runs(coords: np.ndarray) -> list[tuple[int, int, int]]:
    """``[(local start, full start, length)]``: maximal runs of consecutive full indices (padding dropped)."""
    out, start = [], 0
    n = len(coords)
    while start < n:
        if coords[start] < 0:
            start += 1
            continue
        stop = start + 1
        while stop < n and coords[stop] == coords[stop - 1] + 1:
            stop += 1
        out.append((start, int(coords[start]), stop - start))
        start = stop
    return out


def layout_boxes(layout: Layout, local_shape: Sequence[int], rank, size) -> tuple[tuple[int, ...], list[Box]]:
    """``(full shape, boxes)`` of the piece of ``local_shape`` that rank ``rank`` of ``size`` holds under ``layout``
    (rank and size are pairs for a ``GridBlock``, as ``layout.position`` gives them)."""
    local_shape = tuple(int(n) for n in local_shape)
    full_shape = tuple(int(n) for n in layout.full_shape(local_shape, size))
    per_dim = [[(0, 0, n)] for n in local_shape]  # unsplit dims: the whole extent, same index
    for dim, one, r, s in _dim_layouts(layout, rank, size):
        coords = dim_coords(one, full_shape, r, s)
        if len(coords) != local_shape[dim]:
            raise AssertionError(f"{one} gives {len(coords)} rows on dim {dim}, the local piece has "
                                 f"{local_shape[dim]}")
        per_dim[dim] = _runs(coords)
    boxes = [Box((), (), ())]
    for runs in per_dim:
        boxes = [Box(b.local_start + (ls,), b.full_start + (fs,), b.length + (n,)) for b in boxes
                 for ls, fs, n in runs]
    return full_shape, boxes


def clip_rows(boxes: list[Box], start: int, stop: int) -> list[Box]:
    """The parts of ``boxes`` within local rows ``start:stop`` of dim 0, re-based so local row ``start`` is 0 (a
    ZeRO-2/3 rank holds those rows of the tensor-parallel piece)."""
    out = []
    for box in boxes:
        lo = max(start, box.local_start[0])
        hi = min(stop, box.local_start[0] + box.length[0])
        if hi <= lo:
            continue
        shift = lo - box.local_start[0]
        out.append(Box((lo - start,) + box.local_start[1:], (box.full_start[0] + shift,) + box.full_start[1:],
                       (hi - lo,) + box.length[1:]))
    return out


def flat_runs(shape: Sequence[int], start: Sequence[int], length: Sequence[int]) -> tuple[np.ndarray, int]:
    """``(run starts, run length)``: the box ``start:+length`` of a row-major tensor of ``shape`` as contiguous
    runs of elements (flat indices), in the box's own row-major order. A 0-dim tensor is one run of one."""
    shape, start, length = (list(map(int, x)) for x in (shape, start, length))
    if not shape:
        return np.zeros(1, dtype=np.int64), 1
    if any(n == 0 for n in length):
        return np.zeros(0, dtype=np.int64), 0
    strides = np.ones(len(shape), dtype=np.int64)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    inner = len(shape) - 1  # the dims from `inner` on form one run: all full but the outermost of them
    while inner > 0 and length[inner] == shape[inner]:
        inner -= 1
    run = int(length[inner] * strides[inner])
    starts = np.array([int(start[inner] * strides[inner] + sum(s * st for s, st in
                                                               zip(start[inner + 1:], strides[inner + 1:])))],
                      dtype=np.int64)
    for d in range(inner - 1, -1, -1):  # outer dims: every index of the box, outermost slowest
        offsets = (start[d] + np.arange(length[d], dtype=np.int64)) * strides[d]
        starts = (offsets[:, None] + starts[None, :]).reshape(-1)
    return starts, run


def grid_of(boxes) -> list[list[int]]:
    """Per dim, every start and end of ``boxes`` (``(start, length)`` pairs), sorted: the cuts that make boxes of
    different ranks either equal or disjoint (replicated heads packed next to split ones can merge into longer runs
    on one rank than on another)."""
    cuts: list[set[int]] = []
    for start, length in boxes:
        if not cuts:
            cuts = [set() for _ in start]
        for d, (s, n) in enumerate(zip(start, length)):
            cuts[d].update((s, s + n))
    return [sorted(c) for c in cuts]


def split_box(start, length, grid) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """``[(sub start, sub length, offset in the box)]``: the box cut at ``grid`` (see :func:`grid_of`)."""
    per_dim = []
    for s, n, cuts in zip(start, length, grid):
        inner = [c for c in cuts if s < c < s + n]
        edges = [s, *inner, s + n]
        per_dim.append([(a, b - a, a - s) for a, b in zip(edges, edges[1:])])
    out = [((), (), ())]
    for parts in per_dim:
        out = [(a + (s,), b + (n,), c + (o,)) for a, b, c in out for s, n, o in parts]
    return out
