"""Parallel plans as data: which module is split how, read by the model builder, the loader and the saver.

A model family declares one ``ParallelPlan``: a mapping from module-name patterns (``*`` matches one name
component, e.g. ``transformer.h.*.attn.c_attn``) to a style. A style knows three things about its module:

- ``build(module, context)``: the parallel layer that replaces the plain one (on the same device, meta while
  loading);
- ``shard_specs(module)``: for each parameter, the ``ShardSpec`` saying which tensor dim is split, whether it
  holds packed blocks (q|k|v) and whether it is a padded vocabulary;
- ``hf_style``: the ``transformers`` style string published in ``base_model_tp_plan``.

``ShardSpec.read_shard`` cuts this rank's piece out of a full tensor *or* a lazily read checkpoint slice, and
``ShardSpec.gather`` reassembles the full tensor from all ranks' pieces, so slicing and gathering share one
definition of the layout. Under the 2D / 2.5D modes a spec splits up to two dims over two named mesh axes
(``read_local`` / ``gather_local`` / ``local_shape_in`` take the context and read the axes from it).

The tensor-parallel mode decides *how* a style is built: a style says what its module is (column-parallel,
vocabulary embedding, norm on the residual stream...); ``context.tensor_parallel_mode`` picks the 1D (Megatron)
layer or the 2D/2.5D one (``tensor_parallel_2d.py``, built through ``_build_for_mode``). The model files and
their plans do not change with the mode.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
from torch import nn

from .mappings import _all_gather, group_size
from .tensor_parallel import (
    ColumnParallelLinear,
    ParallelDropout,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    divide,
    padded_size,
)

Reader = Callable[[tuple], torch.Tensor]  # index (tuple of slices) -> tensor piece


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out over the tensor-parallel group.

    ``dim=None``: replicated. ``num_packed``: the split dim holds that many equal blocks, each split on its own.
    ``vocab_size``: the split dim is a vocabulary of that many rows, padded with zero rows up to a multiple of
    the group size; the padding exists only on the ranks, never in a checkpoint.
    ``num_heads``: the split dim holds that many attention heads (grouped-query key/value projections), which are
    never cut: at ``tp <= num_heads`` each rank holds ``num_heads/tp`` whole heads; at ``tp > num_heads`` each head
    is replicated on ``tp/num_heads`` consecutive ranks (rank ``r`` holds head ``r // (tp/num_heads)``, the
    Megatron rule) and gathering keeps one copy of each.
    ``axis``: the ``ParallelContext`` axis the split dim is cut over: ``"tp"`` (everything above), or ``"ep"``
    for the stacked expert weights of a mixture-of-experts layer (dim 0 = experts, contiguous blocks per rank).

    ``axis``: the mesh axis ``dim`` is split over (``"tp"``, or a sub-axis of the 2D/2.5D grid). ``dim2``/``axis2``:
    a second dim split (evenly, no packing or padding) over a second axis, for the ``q x q`` weight blocks of
    the 2D modes; the piece of rank ``(a, b)`` is the block ``(a-th of dim, b-th of dim2)``.
    """

    dim: int | None = None
    num_packed: int = 1
    vocab_size: int | None = None
    num_heads: int | None = None
    axis: str = "tp"
    dim2: int | None = None
    axis2: str | None = None

    # -------------------------------------------------------------- context-aware (any mode)
    # ``axis`` may also be a tuple of mesh axes, outermost first (3D: a weight's rows over ``("tp_col", "tp_dep")``):
    # the piece index is the ranks combined in that order, and gathering runs innermost axis first.
    def _first(self) -> "ShardSpec":
        return replace(self, dim2=None, axis2=None)

    def local_shape_in(self, full_shape: tuple[int, ...], context) -> tuple[int, ...]:
        """This rank's shape for a full tensor of ``full_shape`` under ``context``'s layout."""
        if self.dim is None:
            return tuple(full_shape)
        shape = self._first().local_shape(full_shape, _axis_info(context, self.axis).size)
        if self.dim2 is not None:
            shape = ShardSpec(self.dim2).local_shape(shape, _axis_info(context, self.axis2).size)
        return tuple(shape)

    def full_shape_of(self, local_shape: tuple[int, ...], context) -> tuple[int, ...]:
        """The full shape a local piece of ``local_shape`` comes from (the vocabulary without padding)."""
        if self.dim is None:
            return tuple(local_shape)
        shape = self._first().full_shape(local_shape, _axis_info(context, self.axis).size)
        if self.dim2 is not None:
            shape = ShardSpec(self.dim2).full_shape(shape, _axis_info(context, self.axis2).size)
        return tuple(shape)

    def read_local(self, full_shape: tuple[int, ...], read: Reader, context) -> torch.Tensor:
        """This rank's piece under ``context`` (1D: ``read_shard``; 2D: the block of this rank's two axes)."""
        if self.dim is None:
            return read(tuple(slice(None) for _ in full_shape))
        first = _axis_info(context, self.axis)
        if self.dim2 is None:
            return self.read_shard(full_shape, read, first.rank, first.size)
        second, dim2 = _axis_info(context, self.axis2), self.dim2

        def read_first(index: tuple) -> torch.Tensor:
            def read_both(index2: tuple) -> torch.Tensor:
                merged = list(index)
                merged[dim2] = index2[dim2]
                return read(tuple(merged))

            return ShardSpec(dim2).read_shard(full_shape, read_both, second.rank, second.size)

        narrowed = list(full_shape)
        narrowed[dim2] = ShardSpec(dim2).local_shape(full_shape, second.size)[dim2]  # shape of zero padding
        return self._first().read_shard(tuple(narrowed), read_first, first.rank, first.size)

    def num_replicas(self, context) -> int:
        """How many tensor-parallel ranks hold each piece (1 under 1D unless key/value heads are replicated, see
        ``replicas``; under 2D a bias split over the row is held by the ``q`` ranks of each column). Norms over the
        tensor-parallel group divide by it. Expert (``axis="ep"``) pieces are not split over tensor parallelism:
        every tp rank of an expert-parallel rank holds them, so the answer is ``tp_size``."""
        if self.dim is None or self.axis == "ep":
            return context.tp_size
        first = _axis_info(context, self.axis).size
        split = first * (_axis_info(context, self.axis2).size if self.dim2 is not None else 1)
        return context.tp_size // split * self.replicas(first)

    def gather_local(self, local: torch.Tensor, context) -> torch.Tensor:
        """The full tensor from every rank's piece (collective over this spec's axes; padding stripped)."""
        if self.dim is None:
            return local
        if self.dim2 is not None:
            local = _gather_over(ShardSpec(self.dim2), local, context, self.axis2)
        return _gather_over(self._first(), local, context, self.axis)

    @property
    def padded_vocab(self) -> bool:
        return self.vocab_size is not None

    def replicas(self, tp_size: int) -> int:
        """How many tensor-parallel ranks hold each piece (1 unless heads are replicated, see ``num_heads``)."""
        if self.dim is None or self.num_heads is None or tp_size <= self.num_heads:
            return 1
        if tp_size % self.num_heads:
            raise ValueError(f"tensor_parallel_size = {tp_size} is not a multiple of the {self.num_heads} key/value "
                             "heads it must replicate")
        return tp_size // self.num_heads

    def local_shape(self, full_shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full_shape)
        shape = list(full_shape)
        if self.num_heads is not None:
            shape[self.dim] = self._head_block(shape[self.dim], tp_size)[1]
        elif self.padded_vocab:
            shape[self.dim] = padded_size(shape[self.dim], tp_size) // tp_size
        else:
            block = divide(shape[self.dim], self.num_packed, "packed size")
            shape[self.dim] = divide(block, tp_size, "split size") * self.num_packed
        return tuple(shape)

    def full_shape(self, local_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        """The stored (checkpoint) shape that a parameter of ``local_shape`` on a group of ``size`` ranks stands
        for: the inverse of ``local_shape`` (vocabulary padding dropped, replicated heads counted once)."""
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] = (self.vocab_size if self.padded_vocab
                               else shape[self.dim] * size // self.replicas(size))
        return tuple(shape)

    def read_shard(self, full_shape: tuple[int, ...], read: Reader, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's piece, reading only the rows/columns it owns through ``read``."""
        everything = tuple(slice(None) for _ in full_shape)
        if self.dim is None or tp_size == 1 and not self.padded_vocab:
            return read(everything)
        dim, size = self.dim, full_shape[self.dim]

        def index(start: int, stop: int) -> tuple:
            idx = list(everything)
            idx[dim] = slice(start, stop)
            return tuple(idx)

        if self.num_heads is not None:
            _, per_rank = self._head_block(size, tp_size)
            start = tp_rank // self.replicas(tp_size) * per_rank
            return read(index(start, start + per_rank))
        if self.padded_vocab:
            per_rank = padded_size(size, tp_size) // tp_size
            start = tp_rank * per_rank
            stop = min(start + per_rank, size)
            piece = read(index(start, max(start, stop))) if stop > start else None
            num_pad = per_rank - max(0, stop - start)
            if num_pad == 0:
                return piece
            pad_shape = list(full_shape)
            pad_shape[dim] = num_pad
            ref = piece if piece is not None else read(index(0, 1))
            pad = torch.zeros(pad_shape, dtype=ref.dtype)
            return pad if piece is None else torch.cat([piece, pad], dim=dim)
        block = divide(size, self.num_packed, "packed size")
        per_rank = divide(block, tp_size, "split size")
        pieces = [read(index(p * block + tp_rank * per_rank, p * block + (tp_rank + 1) * per_rank))
                  for p in range(self.num_packed)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def gather(self, local: torch.Tensor, group) -> torch.Tensor:
        """Full tensor from every rank's piece (all-gather over ``group``); padding rows stripped."""
        if self.dim is None or group_size(group) == 1 and not self.padded_vocab:
            return local
        full = _all_gather(local, group, self.dim)
        replicas = self.replicas(group_size(group))
        if replicas > 1:  # one copy of each replicated head
            return torch.cat(full.chunk(group_size(group), dim=self.dim)[::replicas], dim=self.dim)
        if self.padded_vocab:
            return full.narrow(self.dim, 0, self.vocab_size)
        if self.num_packed > 1:
            tp = group_size(group)
            ranks = [part.chunk(self.num_packed, dim=self.dim) for part in full.chunk(tp, dim=self.dim)]
            full = torch.cat([ranks[r][p] for p in range(self.num_packed) for r in range(tp)], dim=self.dim)
        return full


    def _head_block(self, size: int, tp_size: int) -> tuple[int, int]:
        """(heads per rank, rows per rank) along the split dim for ``num_heads`` whole heads."""
        if size % self.num_heads:
            raise ValueError(f"split size {size} does not hold {self.num_heads} equal heads")
        if tp_size > self.num_heads:
            self.replicas(tp_size)  # raises when the heads cannot be replicated evenly
            return 1, size // self.num_heads
        heads = divide(self.num_heads, tp_size, "number of key/value heads")
        return heads, heads * (size // self.num_heads)


def _axis_names(axis) -> tuple[str, ...]:
    return axis if isinstance(axis, tuple) else (axis,)


def _axis_info(context, axis):
    """Rank and size of a mesh axis, or of several combined (outermost first)."""
    rank, size = 0, 1
    for name in _axis_names(axis):
        info = context.axis(name)
        rank, size = rank * info.size + info.rank, size * info.size
    return _Combined(rank, size)


@dataclass(frozen=True)
class _Combined:
    rank: int
    size: int


def _gather_over(spec: ShardSpec, local: torch.Tensor, context, axis) -> torch.Tensor:
    """``spec.gather`` over one axis, or over several: plain all-gathers over the inner ones first."""
    *outer, last = _axis_names(axis)
    for name in reversed((*outer, last)[1:]):
        local = _all_gather(local, context.axis(name).group, spec.dim)
    return spec.gather(local, context.axis(_axis_names(axis)[0]).group)


# ---------------------------------------------------------------------------------------------- styles
class Style:
    hf_style = "replicate"

    def build(self, module: nn.Module, context) -> nn.Module:
        return module

    def shard_specs(self, module: nn.Module) -> dict[str, ShardSpec]:
        return {}


def _weight_out_dim(module) -> int:
    return 0 if getattr(module, "layout", "linear") == "linear" else 1


@dataclass(frozen=True)
class Colwise(Style):
    """Column-parallel linear. ``num_packed``: fused blocks (q|k|v). ``vocab``: LM head over a padded vocab."""

    num_packed: int = 1
    vocab: bool = False
    gather_output: bool = False

    @property
    def hf_style(self) -> str:
        if self.num_packed > 1:
            return "packed_colwise"
        return "colwise_gather_output" if self.vocab else "colwise"

    def build(self, module, context):
        if _grid_mode(context):
            return _build_for_mode("Linear2D", module, context, num_packed=self.num_packed, vocab=self.vocab,
                                   column=True)
        options = dict(num_packed=self.num_packed, gather_output=self.gather_output)
        if self.vocab:
            options["vocab_size"] = getattr(module, "full_out_features", module.out_features)
        return ColumnParallelLinear.from_plain(module, context.tp_group, **options)

    def shard_specs(self, module):
        if hasattr(module, "tp_shard_specs"):
            return module.tp_shard_specs()
        vocab_size = module.vocab_size if self.vocab else None
        specs = {"weight": ShardSpec(_weight_out_dim(module), self.num_packed, vocab_size)}
        if getattr(module, "bias", None) is not None:
            specs["bias"] = ShardSpec(0, self.num_packed, vocab_size)
        return specs


@dataclass(frozen=True)
class Rowwise(Style):
    hf_style = "rowwise"

    def build(self, module, context):
        if _grid_mode(context):
            return _build_for_mode("Linear2D", module, context, column=False)
        return RowParallelLinear.from_plain(module, context.tp_group)

    def shard_specs(self, module):
        if hasattr(module, "tp_shard_specs"):
            return module.tp_shard_specs()
        return {"weight": ShardSpec(1 - _weight_out_dim(module))}


@dataclass(frozen=True)
class VocabEmbedding(Style):
    hf_style = "embedding_rowwise"

    def build(self, module, context):
        if _grid_mode(context):
            return _build_for_mode("VocabEmbedding2D", module, context)
        return VocabParallelEmbedding.from_plain(module, context.tp_group)

    def shard_specs(self, module):
        if hasattr(module, "tp_shard_specs"):
            return module.tp_shard_specs()
        return {"weight": ShardSpec(0, vocab_size=module.vocab_size)}


@dataclass(frozen=True)
class PositionEmbedding(Style):
    """A small table looked up whole and added to the residual stream (position or token-type embeddings).

    1D: replicated (the residual stream is whole on every rank). 2D/2.5D: split over the hidden like the
    stream it joins (``HiddenEmbedding2D``)."""

    def build(self, module, context):
        return _build_for_mode("HiddenEmbedding2D", module, context) if _grid_mode(context) else module

    def shard_specs(self, module):
        return module.tp_shard_specs() if hasattr(module, "tp_shard_specs") else {}


@dataclass(frozen=True)
class SequenceParallelNorm(Style):
    """Replicated norm whose grads are summed over TP ranks when the call is sequence-parallel."""

    hf_style = "sequence_parallel"

    def build(self, module, context):
        if _grid_mode(context):
            return _build_for_mode("LayerNorm2D", module, context)
        return SequenceParallelLayerNorm.from_plain(module, context.tp_group, fused=context.config.fused_ops)

    def shard_specs(self, module):
        return module.tp_shard_specs() if hasattr(module, "tp_shard_specs") else {}


@dataclass(frozen=True)
class TPDropout(Style):
    """Dropout on TP-split activations (``always_split``) or on the residual stream (split only under SP)."""

    always_split: bool = False
    hf_style = None

    def build(self, module, context):
        # 2D/2.5D: every activation differs per rank (split over batch and hidden), so every dropout draws from
        # the rank's own stream.
        always_split = self.always_split or _grid_mode(context)
        return ParallelDropout.from_plain(module, context.tp_group, rng=context.rng, always_split=always_split)


@dataclass(frozen=True)
class StreamLinear(Style):
    """A hidden -> hidden linear outside the tensor-parallel regions (e.g. BERT's MLM transform): replicated under
    1D, where the residual stream is whole; a ``Linear2D`` under 2D/2.5D, where the stream is split."""

    def build(self, module, context):
        return _build_for_mode("Linear2D", module, context) if _grid_mode(context) else module

    def shard_specs(self, module):
        return module.tp_shard_specs() if hasattr(module, "tp_shard_specs") else {}


# ---------------------------------------------------------------------------------------------- mode dispatch
def _grid_mode(context) -> bool:
    """Whether ``context`` runs a grid mode (2D / 2.5D / 3D), even with one rank (the layers then talk to no one)."""
    return getattr(context, "tensor_parallel_mode", "1d") in GRID_MODES


GRID_MODES = ("2d", "2.5d", "3d")


def refuse_grid_mode(context, what: str) -> None:
    """A style with no grid version yet raises here, while the model is built and before any collective."""
    if _grid_mode(context):
        raise NotImplementedError(f"tensor_parallel_mode={context.tensor_parallel_mode!r} does not support {what} "
                                  "yet; use tensor_parallel_mode='1d' for this model")
# 3D: column- and row-parallel linears differ (they swap the two hidden axes); the stream's norms, position
# tables and the model boundary are the 2D ones, run on the cube's (row, col, dep) = (x, y, z) axes.
_LAYERS_3D = {"Linear2D": "Linear3D", "VocabEmbedding2D": "VocabEmbedding3D"}


def _build_for_mode(layer: str, module: nn.Module, context, **options) -> nn.Module:
    from . import tensor_parallel_2d, tensor_parallel_3d  # imported here: they build on ShardSpec from this module

    column = options.pop("column", None)
    if context.tensor_parallel_mode == "3d" and layer == "Linear2D":
        if column is None:  # a StreamLinear: stream -> stream
            return tensor_parallel_3d.StreamLinear3D.from_plain(module, context)
        options["column"] = column
    if context.tensor_parallel_mode == "3d" and layer in _LAYERS_3D:
        return getattr(tensor_parallel_3d, _LAYERS_3D[layer]).from_plain(module, context, **options)
    return getattr(tensor_parallel_2d, layer).from_plain(module, context, **options)


# ---------------------------------------------------------------------------------------------- the plan
def _pattern_to_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


class ParallelPlan:
    """Module-name pattern -> ``Style``. First matching pattern wins; unmatched modules stay replicated."""

    def __init__(self, styles: Mapping[str, Style]):
        self.styles = dict(styles)
        self._compiled = [(_pattern_to_regex(pattern), style) for pattern, style in self.styles.items()]

    def style_for(self, module_name: str) -> Style | None:
        for regex, style in self._compiled:
            if regex.match(module_name):
                return style
        return None

    def apply(self, model: nn.Module, context) -> None:
        """Replace every planned module by its parallel version (in place, any device, meta included)."""
        for name, module in list(model.named_modules()):
            style = self.style_for(name)
            if style is None:
                continue
            replacement = style.build(module, context)
            if replacement is not module:
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        if _grid_mode(context):  # the model boundary keeps HF's full-batch layout (see grid_boundary.py)
            from . import grid_boundary

            grid_boundary.check_fully_planned(model, context.tensor_parallel_mode)
            grid_boundary.install(model, context)

    def shard_spec(self, model: nn.Module, param_name: str) -> ShardSpec:
        """The ``ShardSpec`` of a parameter of ``model`` by its full name (replicated when unplanned)."""
        module_name, _, leaf = param_name.rpartition(".")
        style = self.style_for(module_name)
        if style is None:
            return ShardSpec()
        return style.shard_specs(model.get_submodule(module_name)).get(leaf, ShardSpec())

    def hf_tp_plan(self, base_model_prefix: str = "") -> dict[str, str]:
        """The plan as ``transformers``' ``base_model_tp_plan`` strings, relative to the base model."""
        out = {}
        for pattern, style in self.styles.items():
            if style.hf_style in (None, "replicate"):
                continue
            if base_model_prefix and pattern.startswith(base_model_prefix + "."):
                pattern = pattern[len(base_model_prefix) + 1:]
            out[pattern] = style.hf_style
        return out
