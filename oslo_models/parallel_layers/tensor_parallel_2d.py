"""2D (Optimus) and 2.5D (Tesseract) tensor-parallel layers: the same layers on a ``Grid`` with depth 1 or ``d``.

Every activation is split over batch and hidden: a ``[b, s, h]`` tensor is ``[b/(dq), s, h/q]`` on rank
``(k, i, j)`` (batch block ``k*q + i``, hidden block ``j``; see ``summa.py``). Weights are ``q x q`` blocks: for a
weight stored ``[rows, cols]`` (``[out, in]`` for ``layout="linear"``, ``[in, out]`` for ``"conv1d"``) rank
``(k, i, j)`` holds rows block ``i`` and columns block ``j``, replicated over depth. Vectors along the hidden
(biases, norm scales, hidden-split embeddings) hold block ``j`` and are replicated over ``i`` and ``k``; their
gradients are summed over the column and depth groups (``copy_to_tensor_parallel_region``).

Column- and row-parallel are the same layer here: a ``Colwise`` and a ``Rowwise`` plan style both become
``Linear2D``. The model code is the 1D code: q/k/v heads of block ``j`` land on rank ``j`` of each row because
the packed output is split per block, exactly as in 1D.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Embedding, LayerNorm, Linear, autocast_operands
from .mappings import copy_to_tensor_parallel_region, gather_from_tensor_parallel_region
from .sharding import EvenSplit, GridBlock, Layout, split_layout
from .summa import Grid, gather_ids, reduce_scatter_rows, sum_over, summa_linear
from .tensor_parallel import divide, mask_vocab_padding, padded_size, strip_padding_and_unpack

# Which mesh axis splits a weight dim: rows (dim 0) over the grid's rows, columns (dim 1) over its columns.
_AXIS_OF_DIM = {0: "tp_col", 1: "tp_row"}


def replicated_over_batch(param: torch.Tensor, grid: Grid) -> torch.Tensor:
    """A parameter every batch block uses: forward identity, backward sum over the column and depth groups (the
    ranks of one grid row share a batch block and already hold the same gradient, or their blocks of it). Also
    what the replicated router and experts of an MoE block use (``plan.GridReplicated``)."""
    return copy_to_tensor_parallel_region(copy_to_tensor_parallel_region(param, grid.col.group), grid.dep.group)


def _hidden_spec() -> Layout:
    """A vector along the hidden: block ``j`` (the row axis), replicated over ``i`` and ``k``."""
    return EvenSplit(0, axis="tp_row")


class Linear2D(Linear):
    """``y = x W (+ b)`` with ``W`` in ``q x q`` blocks (SUMMA). Input ``[b/(dq), s, in/q]``, output
    ``[b/(dq), s, out/q]``. Forward: q-step SUMMA (2q broadcasts, or q broadcasts + q reduces). Backward: two
    SUMMA products, all-reduce of the weight gradient over depth, of the bias gradient over column and depth.

    ``num_packed``: the output holds that many blocks (q|k|v), each split over the row. ``vocab_size``: the output
    is a vocabulary padded to a multiple of ``q`` (LM heads); padded logits are ``-inf``.
    """

    def __init__(self, in_features: int, out_features: int, *, grid: Grid, bias: bool = True,
                 layout: str = "linear", num_packed: int = 1, vocab_size: int | None = None, device=None,
                 dtype=None):
        q = grid.q
        self.grid, self.num_packed, self.vocab_size = grid, num_packed, vocab_size
        self.full_in_features, self.full_out_features = in_features, out_features
        if vocab_size is not None:
            local_out = padded_size(out_features, q) // q
        else:
            local_out = divide(divide(out_features, num_packed, "packed output size"), q, "output features") \
                * num_packed
        super().__init__(divide(in_features, q, "input features"), local_out, bias=bias, layout=layout,
                         device=device, dtype=dtype)

    @classmethod
    def from_plain(cls, module, context, *, num_packed: int = 1, vocab: bool = False) -> "Linear2D":
        vocab_size = getattr(module, "full_out_features", module.out_features) if vocab else None
        return cls(module.in_features, module.out_features, grid=Grid.from_context(context),
                   bias=module.bias is not None, layout=getattr(module, "layout", "linear"),
                   num_packed=num_packed, vocab_size=vocab_size, device=module.weight.device,
                   dtype=module.weight.dtype)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        x, weight, bias = autocast_operands(x, self.weight, self.bias)
        y = summa_linear(x, weight, self.grid, self.layout)
        if bias is not None:
            y = y + replicated_over_batch(bias, self.grid)
        if self.vocab_size is not None:
            y = self.mask_vocab_padding(y)
        return y

    # -------------------------------------------------------------- vocabulary heads
    @property
    def group(self) -> Grid:
        """What ``vocab_parallel_cross_entropy`` needs: the vocabulary is split over the row, the batch over the
        column and depth."""
        return self.grid

    @property
    def vocab_start_index(self) -> int:
        return self.grid.row.rank * self.out_features

    def mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        return mask_vocab_padding(logits, self.vocab_start_index, self.vocab_size)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """Local ``[b/(dq), s, out/q]`` -> full ``[b, s, out]`` (padding stripped, packed blocks in order).
        Forward: all-gather over the row, then the column and depth. Backward: split."""
        full = gather_from_tensor_parallel_region(y, self.grid.row.group, dim=-1)
        full = strip_padding_and_unpack(full, self.vocab_size, self.num_packed, self.grid.q)
        return self.grid.gather_rows(full)

    def tp_shard_specs(self) -> dict[str, Layout]:
        out_dim = 0 if self.layout == "linear" else 1
        out = split_layout(out_dim, num_packed=self.num_packed, vocab_size=self.vocab_size, axis=_AXIS_OF_DIM[out_dim])
        specs = {"weight": GridBlock(out, EvenSplit(1 - out_dim, _AXIS_OF_DIM[1 - out_dim]))}
        if self.bias is not None:
            specs["bias"] = split_layout(0, num_packed=self.num_packed, vocab_size=self.vocab_size, axis="tp_row")
        return specs


class LayerNorm2D(LayerNorm):
    """LayerNorm over a hidden split ``q`` ways: input/output ``[b/(dq), s, h/q]``; weight and bias ``[h/q]``.

    Forward: two all-reduces over the row (sum, then sum of squares of the centered values). Backward: the same
    two all-reduces (each rank's hidden block contributes to the statistics all blocks use), and the sum of the
    weight/bias gradients over the column and depth groups.
    """

    def __init__(self, normalized_shape, *, grid: Grid, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        (hidden,) = tuple(normalized_shape) if not isinstance(normalized_shape, int) else (normalized_shape,)
        self.grid, self.full_hidden = grid, hidden
        super().__init__(divide(hidden, grid.q, "hidden size"), eps=eps, elementwise_affine=elementwise_affine,
                         bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_plain(cls, module: nn.LayerNorm, context) -> "LayerNorm2D":
        weight = module.weight
        return cls(module.normalized_shape, grid=Grid.from_context(context), eps=module.eps,
                   elementwise_affine=module.elementwise_affine, bias=module.bias is not None,
                   device=weight.device if weight is not None else None,
                   dtype=weight.dtype if weight is not None else None)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        mean = sum_over(x.sum(-1, keepdim=True), self.grid.row) / self.full_hidden
        centered = x - mean
        var = sum_over((centered * centered).sum(-1, keepdim=True), self.grid.row) / self.full_hidden
        y = centered * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * replicated_over_batch(self.weight, self.grid)
        if self.bias is not None:
            y = y + replicated_over_batch(self.bias, self.grid)
        return y

    def tp_shard_specs(self) -> dict[str, Layout]:
        return {name: _hidden_spec() for name, p in self.named_parameters(recurse=False)}


class VocabEmbedding2D(Embedding):
    """Token embedding ``[V, h]`` in ``q x q`` blocks (vocabulary padded to a multiple of ``q``): rank ``(k, i, j)``
    holds vocabulary block ``i``, hidden block ``j``. Input ``[b/(dq), s]`` ids, output ``[b/(dq), s, h/q]``.

    Forward: all-gather of the ids over the column, lookup of the owned rows (zeros elsewhere), reduce-scatter
    over the column along the batch. Backward: all-gather of the output gradient over the column; the weight
    gradient is summed over depth.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, grid: Grid, padding_idx=None, device=None,
                 dtype=None):
        q = grid.q
        self.grid, self.vocab_size = grid, num_embeddings
        local = padded_size(num_embeddings, q) // q
        self.vocab_start_index = grid.col.rank * local
        super().__init__(local, divide(embedding_dim, q, "hidden size"), device=device, dtype=dtype)
        owned = padding_idx is not None and 0 <= padding_idx - self.vocab_start_index < local
        self.local_padding_idx = padding_idx - self.vocab_start_index if owned else None

    @classmethod
    def from_plain(cls, module: nn.Embedding, context) -> "VocabEmbedding2D":
        return cls(module.num_embeddings, module.embedding_dim, grid=Grid.from_context(context),
                   padding_idx=module.padding_idx, device=module.weight.device, dtype=module.weight.dtype)

    def forward(self, ids: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        grid = self.grid
        weight = copy_to_tensor_parallel_region(self.weight, grid.dep.group)
        all_ids = gather_ids(ids, grid.col)
        local_ids = all_ids - self.vocab_start_index
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings)
        out = F.embedding(local_ids.masked_fill(outside, 0), weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_rows(out, grid.col)

    def tp_shard_specs(self) -> dict[str, Layout]:
        return {"weight": GridBlock(split_layout(0, vocab_size=self.vocab_size, axis="tp_col"), EvenSplit(1, "tp_row"))}


class HiddenEmbedding2D(Embedding):
    """A small table whose rows are looked up whole and added to the residual stream (positions, token types):
    ``[n, h]`` split over the hidden only (block ``j``). Input ``[1 or b/(dq), s]``, output ``[., s, h/q]``.
    Forward: none. Backward: the weight gradient is summed over the column and depth groups."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, grid: Grid, padding_idx=None, device=None,
                 dtype=None):
        self.grid = grid
        super().__init__(num_embeddings, divide(embedding_dim, grid.q, "hidden size"), padding_idx=padding_idx,
                         device=device, dtype=dtype)

    @classmethod
    def from_plain(cls, module: nn.Embedding, context) -> "HiddenEmbedding2D":
        return cls(module.num_embeddings, module.embedding_dim, grid=Grid.from_context(context),
                   padding_idx=module.padding_idx, device=module.weight.device, dtype=module.weight.dtype)

    def forward(self, ids: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        return F.embedding(ids, replicated_over_batch(self.weight, self.grid), padding_idx=self.padding_idx)

    def tp_shard_specs(self) -> dict[str, Layout]:
        return {"weight": EvenSplit(1, axis="tp_row")}


class RMSNorm2D(nn.Module):
    """An RMS norm (scale, no bias; statistic in fp32) over a hidden split ``q`` ways: input/output
    ``[b/(dq), s, h/q]``, weight ``[h/q]``. Forward and backward: one all-reduce over the row (the sum of
    squares); the weight gradient is summed over the column and depth groups. ``formula`` as ``RMSNorm``'s:
    ``"t5"`` rounds to the weight's half dtype after normalizing, ``"llama"`` normalizes in fp32 and rounds to the
    input's dtype before scaling (the fused kernel is not used: its statistic would cover one block only);
    ``"olmo2"`` / ``"gemma"`` normalize and scale (``weight`` / ``1 + weight``) in fp32, then round to the input's."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, grid: Grid, formula: str = "t5", device=None,
                 dtype=None):
        super().__init__()
        self.grid, self.full_hidden, self.variance_epsilon, self.formula = grid, hidden_size, eps, formula
        self.weight = nn.Parameter(torch.ones(divide(hidden_size, grid.q, "hidden size"), device=device,
                                              dtype=dtype))

    @classmethod
    def from_plain(cls, module, context) -> "RMSNorm2D":
        weight = module.weight
        return cls(weight.shape[0], module.variance_epsilon, grid=Grid.from_context(context),
                   formula=getattr(module, "formula", "t5"), device=weight.device, dtype=weight.dtype)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        squares = x.to(torch.float32).pow(2).sum(-1, keepdim=True)
        variance = sum_over(squares, self.grid.row) / self.full_hidden
        weight = replicated_over_batch(self.weight, self.grid)
        if self.formula == "llama":
            return weight * (x.to(torch.float32) * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)
        if self.formula in ("olmo2", "gemma"):  # normalize and scale in fp32; gemma stores ``weight - 1``
            normed = x.float() * torch.rsqrt(variance + self.variance_epsilon)
            scale = 1.0 + weight.float() if self.formula == "gemma" else weight.float()
            return (normed * scale).to(x.dtype)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(weight.dtype)
        return weight * x

    def tp_shard_specs(self) -> dict[str, Layout]:
        return {"weight": _hidden_spec()}
