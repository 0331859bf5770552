"""3D tensor-parallel layers (Bian et al. 2021, arXiv:2105.14450) on a ``q x q x q`` grid.

Rank ``(z, y, x)`` (mesh axes ``tp_dep``, ``tp_col``, ``tp_row``, the names of the 2D grid's axes, so the 2D norms,
position tables and model boundary run unchanged on the cube; ``tp_rank = z*q*q + y*q + x``). Activations come
in two layouts, and every linear turns one into the other:

- stream ``S`` (embeddings, norms, residual adds, the input of column-parallel layers): batch block ``(z, y)``
  (``b/q**2`` rows), hidden block ``x``;
- inner ``I`` (attention heads, FFN hidden, logits: the output of column-parallel layers): batch block
  ``(z, x)``, hidden block ``y``.

A ``Colwise`` style builds ``Linear3D(S -> I)``, a ``Rowwise`` one ``Linear3D(I -> S)``: the model code is the 1D
code. A weight stored ``[rows, cols]`` is split in ``q**3`` blocks: the in/out features over the input's and the
output's hidden axes, and dim 0 once more over ``z``, so each weight element lives on one rank (``1/q**3``).

``Linear3D`` (input hidden axis ``a``, output hidden axis ``b``):

    forward:  X' = all-gather_b(X) (batch)   W' = all-gather_z(W) (dim 0)   Y = reduce-scatter_a(X' W') (batch)
    backward: dY' = all-gather_a(dY) (batch) dX = reduce-scatter_b(dY' W'^T)  dW = reduce-scatter_z(X'^T dY')

Norms reduce their statistics over ``x`` (the stream's hidden axis). Parameters that every batch block uses
(biases, norm scales, position tables) are split over one hidden axis and replicated over the other two, which
sum their gradients. The vocabulary is padded to a multiple of ``q**2``; a vocabulary bias (BERT's MLM decoder)
is split like the head's rows, over ``(y, z)``. A linear that maps the stream to the stream (BERT's MLM
transform) is a column-parallel one followed by a transpose of the blocks (``StreamLinear3D``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .layers import Embedding, Linear, autocast_operands, linear_forward
from .mappings import _all_gather, _reduce_scatter, copy_to_tensor_parallel_region, gather_from_tensor_parallel_region
from .sharding import EvenSplit, GridBlock, Layout, split_layout
from .summa import Grid, _Axis, gather_ids, reduce_scatter_rows
from .tensor_parallel import divide, mask_vocab_padding, padded_size, strip_padding_and_unpack


def _cube(context) -> Grid:
    """The 2D ``Grid`` view of the cube: ``row`` = x (the stream's hidden), ``col`` = y, ``dep`` = z."""
    return Grid.from_context(context)


def _axis(grid: Grid, name: str) -> _Axis:
    return {"tp_row": grid.row, "tp_col": grid.col, "tp_dep": grid.dep}[name]


class _LogitGrid:
    """What ``vocab_parallel_cross_entropy`` needs for logits in the inner layout: vocabulary over ``y``,
    batch block ``(z, x)``."""

    def __init__(self, cube: Grid):
        self.cube = cube

    @property
    def vocab_group(self):
        return self.cube.col.group

    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        cube = self.cube
        return rows.chunk(cube.q * cube.q, dim=0)[cube.dep.rank * cube.q + cube.row.rank]

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        rows = gather_from_tensor_parallel_region(rows, self.cube.row.group, dim=0)
        return gather_from_tensor_parallel_region(rows, self.cube.dep.group, dim=0)


def _replicated(param: torch.Tensor, *axes: _Axis) -> torch.Tensor:
    for axis in axes:
        param = copy_to_tensor_parallel_region(param, axis.group)
    return param


def _gather_dim(x, axis: _Axis, dim: int):
    return _all_gather(x, axis.group if axis.size > 1 else None, dim)


def _scatter_sum_dim(x, axis: _Axis, dim: int):
    return _reduce_scatter(x, axis.group if axis.size > 1 else None, dim)


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cube, in_axis, out_axis, layout):
        ctx.cube, ctx.in_axis, ctx.out_axis, ctx.layout = cube, in_axis, out_axis, layout
        x_full = _gather_dim(x, out_axis, 0)
        w_full = _gather_dim(weight, cube.dep, 0)
        ctx.save_for_backward(x_full, w_full)
        return _scatter_sum_dim(linear_forward(x_full, w_full, None, layout), in_axis, 0)

    @staticmethod
    def backward(ctx, grad):
        x_full, w_full = ctx.saved_tensors
        grad_full = _gather_dim(grad.contiguous(), ctx.in_axis, 0)
        if ctx.layout == "linear":  # W [out, in]: dX = dY W, dW = dY^T X
            grad_x, grad_w = grad_full @ w_full, grad_full.t() @ x_full
        else:                       # W [in, out]: dX = dY W^T, dW = X^T dY
            grad_x, grad_w = grad_full @ w_full.t(), x_full.t() @ grad_full
        return (_scatter_sum_dim(grad_x, ctx.out_axis, 0), _scatter_sum_dim(grad_w, ctx.cube.dep, 0),
                None, None, None, None)


_WEIGHT_DIM_OF = {("linear", "out"): 0, ("linear", "in"): 1, ("conv1d", "in"): 0, ("conv1d", "out"): 1}


class Linear3D(Linear):
    """``S -> I`` (``column=True``, from a ``Colwise`` style) or ``I -> S`` (``Rowwise``); see the module docstring.
    Input ``[b/q**2, s, in/q]``, output ``[b/q**2, s, out/q]``. Forward: all-gather (input, over the output's
    axis), all-gather (weight, over z), reduce-scatter (output, over the input's axis); backward: the mirror.
    ``vocab_size``: an LM head over a vocabulary padded to ``q**2`` (padded logits ``-inf``)."""

    def __init__(self, in_features: int, out_features: int, *, cube: Grid, column: bool, bias: bool = True,
                 layout: str = "linear", num_packed: int = 1, vocab_size: int | None = None, device=None,
                 dtype=None):
        q = cube.q
        self.cube, self.column, self.num_packed, self.vocab_size = cube, column, num_packed, vocab_size
        self.in_axis_name, self.out_axis_name = ("tp_row", "tp_col") if column else ("tp_col", "tp_row")
        if num_packed > 1 and layout == "linear":
            raise NotImplementedError("tensor_parallel_mode='3d': packed projections in nn.Linear layout")
        out_local = padded_size(out_features, q * q) // q if vocab_size is not None else \
            divide(divide(out_features, num_packed, "packed output size"), q, "output features") * num_packed
        in_local = divide(in_features, q, "input features")
        self.full_in_features, self.full_out_features = in_features, out_features
        super().__init__(in_local, out_local, bias=bias, layout=layout, device=device, dtype=dtype)
        # dim 0 of the stored weight is split once more over z
        rows = self.weight.shape[0]
        shape = (divide(rows, q, "weight rows"), self.weight.shape[1])
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if vocab_size is not None and bias:
            # A vocabulary bias (BERT/RoBERTa MLM) is split like the head's rows: block (y, z), padded to q**2
            # with them, and gathered over z in forward like the weight.
            self.bias = nn.Parameter(torch.zeros(out_local // q, device=device, dtype=dtype))

    @classmethod
    def from_plain(cls, module, context, *, column: bool = True, num_packed: int = 1,
                   vocab: bool = False) -> "Linear3D":
        vocab_size = getattr(module, "full_out_features", module.out_features) if vocab else None
        return cls(module.in_features, module.out_features, cube=_cube(context), column=column,
                   bias=module.bias is not None, layout=getattr(module, "layout", "linear"), num_packed=num_packed,
                   vocab_size=vocab_size, device=module.weight.device, dtype=module.weight.dtype)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        cube = self.cube
        in_axis, out_axis = _axis(cube, self.in_axis_name), _axis(cube, self.out_axis_name)
        x, weight = autocast_operands(x, self.weight)
        flat = x.reshape(-1, x.shape[-1])
        y = _Linear3D.apply(flat, weight, cube, in_axis, out_axis, self.layout)
        y = y.view(-1, *x.shape[1:-1], y.shape[-1])
        if self.bias is not None and self.vocab_size is not None:
            y = y + _replicated(_GatherWeightRows.apply(self.bias, cube.dep), in_axis)
        elif self.bias is not None:
            y = y + _replicated(self.bias, in_axis, cube.dep)
        if self.vocab_size is not None:
            y = self.mask_vocab_padding(y)
        return y

    # ---- LM heads
    @property
    def group(self) -> _LogitGrid:
        return _LogitGrid(self.cube)

    @property
    def vocab_start_index(self) -> int:
        return self.cube.col.rank * self.out_features

    def mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        return mask_vocab_padding(logits, self.vocab_start_index, self.vocab_size)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """Output ``[b/q**2, s, out/q]`` -> ``[b, s, out]`` (for logits: the inner layout)."""
        cube = self.cube
        out_axis = _axis(cube, self.out_axis_name)
        full = gather_from_tensor_parallel_region(y, out_axis.group, dim=-1)
        full = strip_padding_and_unpack(full, self.vocab_size, self.num_packed, cube.q)
        rows_axis = _axis(cube, self.in_axis_name)  # the output's batch block is (z, input hidden axis)
        full = gather_from_tensor_parallel_region(full, rows_axis.group, dim=0)
        return gather_from_tensor_parallel_region(full, cube.dep.group, dim=0)

    def tp_shard_specs(self) -> dict[str, Layout]:
        axis_of = {"in": self.in_axis_name, "out": self.out_axis_name}
        out_dim = _WEIGHT_DIM_OF[(self.layout, "out")]
        axes = {dim: axis_of[kind] for (layout, kind), dim in _WEIGHT_DIM_OF.items() if layout == self.layout}
        axes[0] = (axes[0], "tp_dep")
        out = split_layout(out_dim, num_packed=self.num_packed, vocab_size=self.vocab_size, axis=axes[out_dim])
        specs = {"weight": GridBlock(out, EvenSplit(1 - out_dim, axes[1 - out_dim]))}
        if self.bias is not None:
            specs["bias"] = split_layout(0, num_packed=self.num_packed, vocab_size=self.vocab_size,
                                         axis=axes[out_dim] if self.vocab_size else self.out_axis_name)
        return specs


class _SwapBlocks(torch.autograd.Function):
    """Rank ``(z, y, x)`` and rank ``(z, x, y)`` exchange their blocks (one send and one receive each; the
    diagonal keeps its own). A permutation that is its own inverse, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, partner):
        ctx.partner = partner
        return _swap(x, partner)

    @staticmethod
    def backward(ctx, grad):
        return _swap(grad, ctx.partner), None


def _swap(x: torch.Tensor, partner: int | None) -> torch.Tensor:
    if partner is None:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, partner), dist.P2POp(dist.irecv, out, partner)]):
        request.wait()
    return out


class StreamLinear3D(Linear3D):
    """A hidden -> hidden linear that stays on the residual stream (BERT's MLM transform): stream ``S`` in,
    stream ``S`` out. It is the column-parallel ``Linear3D`` (``S -> I``, same weight blocks and collectives),
    then a transpose of the inner layout back to the stream: the inner block of rank ``(z, y, x)`` (batch block
    ``(z, x)``, hidden block ``y``) is the stream block of rank ``(z, x, y)``, so the two swap blocks
    (``_SwapBlocks``: one point-to-point exchange of ``[b/q**2, s, h/q]`` per rank, forward and backward)."""

    def __init__(self, *args, partner: int | None = None, **kwargs):
        super().__init__(*args, column=True, **kwargs)
        self.partner = partner

    @classmethod
    def from_plain(cls, module, context, **options) -> "StreamLinear3D":
        cube = _cube(context)
        x, y, z = cube.row.rank, cube.col.rank, cube.dep.rank
        partner = None if x == y else context.axis("tp").ranks[(z * cube.q + x) * cube.q + y]
        return cls(module.in_features, module.out_features, cube=cube, bias=module.bias is not None,
                   layout=getattr(module, "layout", "linear"), partner=partner, device=module.weight.device,
                   dtype=module.weight.dtype)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        return _SwapBlocks.apply(super().forward(x), self.partner)


class _GatherWeightRows(torch.autograd.Function):
    """Forward: all-gather over z along dim 0. Backward: reduce-scatter over z (each z saw other tokens)."""

    @staticmethod
    def forward(ctx, weight, axis):
        ctx.axis = axis
        return _gather_dim(weight, axis, 0)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_sum_dim(grad.contiguous(), ctx.axis, 0), None


class VocabEmbedding3D(Embedding):
    """Token embedding stored like the tied LM head: vocabulary block ``(y, z)`` (padded to ``q**2``), hidden block
    ``x``. Input ids in the stream's batch block, output ``[b/q**2, s, h/q]`` (stream). Forward: all-gather of the
    weight over z and of the ids over y, lookup, reduce-scatter over y along the batch. Backward: all-gather over
    y, reduce-scatter of the weight gradient over z."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, cube: Grid, padding_idx=None, device=None,
                 dtype=None):
        q = cube.q
        self.cube, self.vocab_size = cube, num_embeddings
        self.block = padded_size(num_embeddings, q * q) // q  # rows of vocabulary block y
        self.vocab_start_index = cube.col.rank * self.block
        super().__init__(self.block // q, divide(embedding_dim, q, "hidden size"), device=device, dtype=dtype)
        owned = padding_idx is not None and 0 <= padding_idx - self.vocab_start_index < self.block
        self.local_padding_idx = padding_idx - self.vocab_start_index if owned else None

    @classmethod
    def from_plain(cls, module, context) -> "VocabEmbedding3D":
        return cls(module.num_embeddings, module.embedding_dim, cube=_cube(context),
                   padding_idx=module.padding_idx, device=module.weight.device, dtype=module.weight.dtype)

    def forward(self, ids: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        cube = self.cube
        weight = _GatherWeightRows.apply(self.weight, cube.dep) if cube.dep.size > 1 else self.weight
        local_ids = gather_ids(ids, cube.col) - self.vocab_start_index
        outside = (local_ids < 0) | (local_ids >= self.block)
        out = F.embedding(local_ids.masked_fill(outside, 0), weight, padding_idx=self.local_padding_idx)
        return reduce_scatter_rows(out.masked_fill(outside.unsqueeze(-1), 0.0), cube.col)

    def tp_shard_specs(self) -> dict[str, Layout]:
        vocab = split_layout(0, vocab_size=self.vocab_size, axis=("tp_col", "tp_dep"))
        return {"weight": GridBlock(vocab, EvenSplit(1, "tp_row"))}


class HiddenEmbedding3D(Embedding):
    """A table looked up whole, split over one hidden axis: positions (stream, ``x``) or T5's relative attention
    bias (heads, ``y``). Gradients summed over the two other axes."""

    def __init__(self, num_embeddings, embedding_dim, *, cube: Grid, axis: str, padding_idx=None, device=None,
                 dtype=None):
        self.cube, self.axis_name = cube, axis
        super().__init__(num_embeddings, divide(embedding_dim, cube.q, "hidden size"), padding_idx=padding_idx,
                         device=device, dtype=dtype)

    @classmethod
    def from_plain(cls, module, context, *, axis: str = "tp_col") -> "HiddenEmbedding3D":
        return cls(module.num_embeddings, module.embedding_dim, cube=_cube(context), axis=axis,
                   padding_idx=module.padding_idx, device=module.weight.device, dtype=module.weight.dtype)

    def forward(self, ids: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        others = [axis for name, axis in (("tp_row", self.cube.row), ("tp_col", self.cube.col),
                                          ("tp_dep", self.cube.dep)) if name != self.axis_name]
        return F.embedding(ids, _replicated(self.weight, *others), padding_idx=self.padding_idx)

    def tp_shard_specs(self) -> dict[str, Layout]:
        return {"weight": EvenSplit(1, axis=self.axis_name)}
