"""The tensor-parallel grid of the 2D (Optimus) and 2.5D (Tesseract) modes and its SUMMA collectives.

A ``Grid`` is this rank's view of ``d`` stacked ``q x q`` grids (``d = 1`` for 2D). Rank ``(k, i, j)`` sits in
depth layer ``k``, grid row ``i``, grid column ``j``. Three groups, all from the context's named mesh axes:

- ``row_group`` (mesh axis ``tp_row``): the ``q`` ranks of this grid row (``i``, ``k`` fixed); rank = ``j``;
- ``col_group`` (mesh axis ``tp_col``): the ``q`` ranks of this grid column (``j``, ``k`` fixed); rank = ``i``;
- ``dep_group`` (mesh axis ``tp_dep``): the ``d`` ranks at the same ``(i, j)`` in each layer; rank = ``k``.

Layout of a matrix ``M`` split ``q x q``: rank ``(k, i, j)`` holds block ``M_ij`` (rows block ``i``, columns
block ``j``). Activations ``[b, s, h]`` are split over the batch ``d*q`` ways (block ``k*q + i``) and over the
hidden ``q`` ways (block ``j``); weights ``q x q`` and replicated over depth (Tesseract).

SUMMA (van de Geijn & Watts 1997; Optimus, Xu et al. 2021, arXiv:2104.05343) computes ``C = A B`` in ``q`` steps:
step ``t`` broadcasts ``A_it`` along the row and ``B_tj`` along the column, and every rank accumulates
``A_it B_tj``. The transposed products run the same loop with a reduce in place of one broadcast:

| product     | step t on rank (i, j)                                                            | collectives |
|-------------|-----------------------------------------------------------------------------------|-------------|
| ``A B``     | ``C_ij += bcast_row(A_it) @ bcast_col(B_tj)``                                     | 2 broadcast |
| ``A B^T``   | ``C_it = reduce_row(A_ij @ bcast_col(B_tj)^T)`` (kept by ``j == t``)              | broadcast + reduce |
| ``A^T B``   | ``C_tj = reduce_col(bcast_row(A_it)^T @ B_ij)`` (kept by ``i == t``)              | broadcast + reduce |

All blocks are 2-D ``[rows, cols]`` (activations are flattened to ``[tokens, hidden]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Axis:
    group: object  # ProcessGroup, or None for a size-1 axis
    size: int
    rank: int
    ranks: tuple[int, ...]  # global ranks, in axis order (broadcast/reduce address them)


@dataclass(frozen=True)
class Grid:
    """This rank's place in the ``d x q x q`` grid of a ``ParallelContext`` in mode ``"2d"`` or ``"2.5d"``."""

    row: _Axis
    col: _Axis
    dep: _Axis

    @classmethod
    def from_context(cls, context) -> "Grid":
        def axis(name):
            if name not in context._axes:
                return _Axis(None, 1, 0, (context.rank,))
            info = context.axis(name)
            return _Axis(info.group, info.size, info.rank, info.ranks)

        return cls(row=axis("tp_row"), col=axis("tp_col"), dep=axis("tp_dep"))

    @property
    def q(self) -> int:
        return self.row.size

    @property
    def batch_parts(self) -> int:
        """How many blocks the batch is split into (``d * q``)."""
        return self.dep.size * self.col.size

    @property
    def batch_rank(self) -> int:
        """This rank's batch block (``k * q + i``)."""
        return self.dep.rank * self.col.size + self.col.rank

    # The cross-entropy reads these (see ``cross_entropy.vocab_parallel_cross_entropy``).
    @property
    def vocab_group(self):
        return self.row.group

    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's batch block of a tensor whose dim 0 is the full batch (or batch-major tokens)."""
        return rows.chunk(self.batch_parts, dim=0)[self.batch_rank]

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """All batch blocks (dim 0) from every rank. Forward: all-gather over column, then depth; backward: split."""
        from .mappings import gather_from_tensor_parallel_region

        rows = gather_from_tensor_parallel_region(rows, self.col.group, dim=0)
        return gather_from_tensor_parallel_region(rows, self.dep.group, dim=0)


# ---------------------------------------------------------------------------------------------- raw collectives
# Under torch.compile these run eagerly, as a unit: dynamo cannot trace the in-place subgroup broadcasts and
# reduces, and falling back frame by frame made it compile each helper once per weight shape (static parameter
# shapes), past its recompile limit: a 2D grid model took minutes to compile and then ran these uncompiled anyway.
_eager = torch.compiler.disable


@_eager
def _broadcast(x: torch.Tensor, axis: _Axis, src: int) -> torch.Tensor:
    """``x`` of axis rank ``src`` on every rank of ``axis`` (others pass a buffer of the same shape)."""
    if axis.size == 1:
        return x
    buffer = x.contiguous().clone() if axis.rank == src else torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.broadcast(buffer, src=axis.ranks[src], group=axis.group)
    return buffer


@_eager
def _reduce(x: torch.Tensor, axis: _Axis, dst: int) -> torch.Tensor:
    """Sum of ``x`` over ``axis``; meaningful on axis rank ``dst`` only."""
    if axis.size == 1:
        return x
    out = x.contiguous().clone()
    dist.reduce(out, dst=axis.ranks[dst], group=axis.group)
    return out


@_eager
def all_reduce(x: torch.Tensor, axis: _Axis) -> torch.Tensor:
    if axis.size == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=axis.group)
    return out


# ---------------------------------------------------------------------------------------------- SUMMA products
@_eager
def summa_ab(a: torch.Tensor, b: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``C_ij = sum_t A_it B_tj``: ``a`` ``[m, k/q]``, ``b`` ``[k/q, n/q]`` -> ``[m, n/q]``. 2q broadcasts."""
    out = None
    for t in range(grid.q):
        part = _broadcast(a, grid.row, t) @ _broadcast(b, grid.col, t)
        out = part if out is None else out + part
    return out


@_eager
def summa_abt(a: torch.Tensor, b: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``C_ij = sum_t A_it B_jt^T``: ``a`` ``[m, k/q]``, ``b`` ``[n/q, k/q]`` -> ``[m, n/q]``. q broadcasts (column)
    and q reduces (row)."""
    out = None
    for t in range(grid.q):
        part = _reduce(a @ _broadcast(b, grid.col, t).t(), grid.row, t)
        if t == grid.row.rank:
            out = part
    return out


@_eager
def summa_atb(a: torch.Tensor, b: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``C_ij = sum_t A_ti^T B_tj``: ``a`` ``[m/q, k/q]`` (rows: the contracted dim), ``b`` ``[m/q, n/q]`` ->
    ``[k/q, n/q]``. q broadcasts (row) and q reduces (column)."""
    out = None
    for t in range(grid.q):
        part = _reduce(_broadcast(a, grid.row, t).t() @ b, grid.col, t)
        if t == grid.col.rank:
            out = part
    return out


class _SummaLinear(torch.autograd.Function):
    """``y = x W`` (``layout="conv1d"``, ``W`` block ``[in/q, out/q]``) or ``y = x W^T`` (``"linear"``, ``W`` block
    ``[out/q, in/q]``) on the grid; ``x`` ``[tokens/(dq), in/q]`` -> ``y`` ``[tokens/(dq), out/q]``.

    Forward: one SUMMA product (AB or AB^T). Backward: two (the input and weight gradients), then an all-reduce
    of the weight gradient over depth (2.5D: every depth layer saw different tokens of the same weight).
    """

    @staticmethod
    def forward(ctx, x, weight, grid, layout):
        ctx.save_for_backward(x, weight)
        ctx.grid, ctx.layout = grid, layout
        return summa_ab(x, weight, grid) if layout == "conv1d" else summa_abt(x, weight, grid)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grid = ctx.grid
        grad = grad.contiguous()
        if ctx.layout == "conv1d":
            grad_x = summa_abt(grad, weight, grid)   # dX = dY W^T
            grad_w = summa_atb(x, grad, grid)        # dW = X^T dY
        else:
            grad_x = summa_ab(grad, weight, grid)    # dX = dY W
            grad_w = summa_atb(grad, x, grid)        # dW = dY^T X
        return grad_x, all_reduce(grad_w, grid.dep), None, None


def summa_linear(x: torch.Tensor, weight: torch.Tensor, grid: Grid, layout: str) -> torch.Tensor:
    """``[..., in/q]`` -> ``[..., out/q]`` (see ``_SummaLinear``); leading dims are this rank's tokens."""
    flat = x.reshape(-1, x.shape[-1])
    out = _SummaLinear.apply(flat, weight, grid, layout)
    return out.view(*x.shape[:-1], out.shape[-1])


class _AllReduceSum(torch.autograd.Function):
    """Forward: all-reduce (sum) over ``axis``. Backward: all-reduce too: every rank of the axis goes on to use
    the sum differently (its own hidden block), so each holds only part of the gradient of the sum."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.axis), None


def sum_over(x: torch.Tensor, axis: _Axis) -> torch.Tensor:
    """Sum of per-rank partial values over ``axis`` (e.g. layer-norm statistics over the hidden blocks of a row).
    Forward and backward: all-reduce."""
    return x if axis.size == 1 else _AllReduceSum.apply(x, axis)


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0 over ``axis``. Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        parts = [p.contiguous() for p in x.chunk(axis.size, dim=0)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=axis.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.axis.size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.axis.group)
        return torch.cat(parts, dim=0), None


def reduce_scatter_rows(x: torch.Tensor, axis: _Axis) -> torch.Tensor:
    """Partial sums ``[n, ...]`` -> summed block ``[n/size, ...]`` of this rank. Backward: all-gather."""
    return x if axis.size == 1 else _ReduceScatterRows.apply(x, axis)


def gather_ids(ids: torch.Tensor, axis: _Axis) -> torch.Tensor:
    """Integer ids of every rank of ``axis`` along dim 0 (no gradient)."""
    if axis.size == 1:
        return ids
    parts = [torch.empty_like(ids) for _ in range(axis.size)]
    dist.all_gather(parts, ids.contiguous(), group=axis.group)
    return torch.cat(parts, dim=0)
