"""Parallel plans as data: which module is split how, read by the model builder, the loader and the saver.

A model family declares one ``ParallelPlan``: a mapping from module-name patterns (``*`` matches one name
component, e.g. ``transformer.h.*.attn.c_attn``) to a style. A style knows three things about its module:

- ``build(module, context)``: the parallel layer that replaces the plain one (on the same device, meta while
  loading);
- ``shard_specs(module)``: for each parameter, its ``Layout`` (``sharding.py``): which tensor dim is split over
  which mesh axis, whether it holds packed blocks (q|k|v), whole heads or a padded vocabulary. A built layer that
  knows its own layout (every grid layer) says so in ``tp_shard_specs()``, which ``Style.shard_specs`` consults;
- ``hf_style``: the ``transformers`` style string published in ``base_model_tp_plan``.

The tensor-parallel mode decides *how* a style is built: a style says what its module is (``grid_layer``:
column-parallel, vocabulary embedding, norm on the residual stream...); under a grid mode (``context.is_grid``:
2D / 2.5D / 3D) ``GRID_LAYERS[mode][grid_layer]`` builds the grid layer, otherwise the style's ``build_1d`` the
Megatron one. The model files and their plans do not change with the mode.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping

from torch import nn

from . import grid_boundary
from .sharding import REPLICATED, EvenSplit, Layout, split_layout
from .summa import Grid
from .tensor_parallel import (
    ColumnParallelLinear,
    ParallelDropout,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
)
from .tensor_parallel_2d import HiddenEmbedding2D, LayerNorm2D, Linear2D, RMSNorm2D, VocabEmbedding2D
from .tensor_parallel_3d import HiddenEmbedding3D, Linear3D, StreamLinear3D, VocabEmbedding3D

# ---------------------------------------------------------------------------------------------- mode dispatch
# What a style's module becomes under each grid mode: ``GRID_LAYERS[mode][kind](module, context, **options)``.
# 3D: column- and row-parallel linears differ (they swap the two hidden axes) and the heads of a head-wise table
# live in the inner layout (over y); the stream's norms, position tables and the model boundary are the 2D ones,
# run on the cube's (row, col, dep) = (x, y, z) axes.
_GRID_2D: dict[str, Callable[..., nn.Module]] = {
    "colwise": Linear2D.from_plain,
    "rowwise": Linear2D.from_plain,
    "stream_linear": Linear2D.from_plain,
    "vocab_embedding": VocabEmbedding2D.from_plain,
    "hidden_embedding": HiddenEmbedding2D.from_plain,
    "head_embedding": HiddenEmbedding2D.from_plain,  # heads follow the grid's column blocks
    "layer_norm": LayerNorm2D.from_plain,
    "rms_norm": RMSNorm2D.from_plain,
}
_GRID_3D = {
    **_GRID_2D,
    "colwise": partial(Linear3D.from_plain, column=True),
    "rowwise": partial(Linear3D.from_plain, column=False),
    "stream_linear": StreamLinear3D.from_plain,
    "vocab_embedding": VocabEmbedding3D.from_plain,
    "head_embedding": partial(HiddenEmbedding3D.from_plain, axis="tp_col"),
}
GRID_LAYERS: dict[str, dict[str, Callable[..., nn.Module]]] = {"2d": _GRID_2D, "2.5d": _GRID_2D, "3d": _GRID_3D}


def build_grid_layer(kind: str, module: nn.Module, context, **options) -> nn.Module:
    """The grid layer of ``kind`` for ``context``'s mode, built from the plain ``module``."""
    return GRID_LAYERS[context.tensor_parallel_mode][kind](module, context, **options)


def refuse_grid_mode(context, what: str) -> None:
    """A style with no grid version yet raises here, while the model is built and before any collective."""
    if context.is_grid:
        raise NotImplementedError(f"tensor_parallel_mode={context.tensor_parallel_mode!r} does not support {what} "
                                  "yet; use tensor_parallel_mode='1d' for this model")


def grid_batch_replicated(module: nn.Module, context, what: str) -> nn.Module:
    """Under 2D / 2.5D: mark ``module`` (whole weights on every rank, run on whole tokens of this rank's batch block,
    which its block gathers over the grid row: an MoE block's router and experts) as planned and give it the
    ``Grid``; its forward then passes its weights through ``tensor_parallel_2d.replicated_over_batch`` (backward:
    their gradients summed over the column and depth groups, which saw the other batch blocks). 3D: refused (its
    activations change layout inside a block). 1D: unchanged."""
    if not context.is_grid:
        return module
    if context.tensor_parallel_mode == "3d":
        raise NotImplementedError(f"tensor_parallel_mode='3d' does not support {what} yet (the cube's activations "
                                  "take two layouts; the 2D and 2.5D grids run them); use tensor_parallel_mode="
                                  "'2d', '2.5d' or '1d' for this model")
    module.grid, module.grid_planned = Grid.from_context(context), True
    return module


def _weight_out_dim(module) -> int:
    return 0 if getattr(module, "layout", "linear") == "linear" else 1


# ---------------------------------------------------------------------------------------------- styles
class Style:
    """What a module is. ``grid_layer``: its kind in ``GRID_LAYERS`` (``None``: the 1D build in every mode)."""

    hf_style = "replicate"
    grid_layer: str | None = None

    def build(self, module: nn.Module, context) -> nn.Module:
        if self.grid_layer is not None and context.is_grid:
            return build_grid_layer(self.grid_layer, module, context, **self.grid_options())
        return self.build_1d(module, context)

    def build_1d(self, module: nn.Module, context) -> nn.Module:
        return module

    def grid_options(self) -> dict:
        return {}

    def shard_specs(self, module: nn.Module) -> dict[str, Layout]:
        """Each parameter's layout: the built module's own (``tp_shard_specs``) or the style's (``layouts``)."""
        own = getattr(module, "tp_shard_specs", None)
        return own() if own is not None else self.layouts(module)

    def layouts(self, module: nn.Module) -> dict[str, Layout]:
        """The layouts of a built module that does not state its own; unlisted parameters are replicated."""
        return {}


@dataclass(frozen=True)
class Colwise(Style):
    """Column-parallel linear. ``num_packed``: fused blocks (q|k|v). ``vocab``: LM head over a padded vocab."""

    num_packed: int = 1
    vocab: bool = False
    gather_output: bool = False
    grid_layer = "colwise"

    @property
    def hf_style(self) -> str:
        if self.num_packed > 1:
            return "packed_colwise"
        return "colwise_gather_output" if self.vocab else "colwise"

    def grid_options(self) -> dict:
        return dict(num_packed=self.num_packed, vocab=self.vocab)

    def build_1d(self, module, context):
        options = dict(num_packed=self.num_packed, gather_output=self.gather_output)
        if self.vocab:
            options["vocab_size"] = getattr(module, "full_out_features", module.out_features)
        return ColumnParallelLinear.from_plain(module, context.tp_group, **options)

    def layouts(self, module):
        vocab_size = module.vocab_size if self.vocab else None
        specs = {"weight": split_layout(_weight_out_dim(module), num_packed=self.num_packed, vocab_size=vocab_size)}
        if getattr(module, "bias", None) is not None:
            specs["bias"] = split_layout(0, num_packed=self.num_packed, vocab_size=vocab_size)
        return specs


@dataclass(frozen=True)
class Rowwise(Style):
    hf_style = "rowwise"
    grid_layer = "rowwise"

    def build_1d(self, module, context):
        return RowParallelLinear.from_plain(module, context.tp_group)

    def layouts(self, module):
        return {"weight": EvenSplit(1 - _weight_out_dim(module))}


@dataclass(frozen=True)
class VocabEmbedding(Style):
    hf_style = "embedding_rowwise"
    grid_layer = "vocab_embedding"

    def build_1d(self, module, context):
        return VocabParallelEmbedding.from_plain(module, context.tp_group)

    def layouts(self, module):
        return {"weight": split_layout(0, vocab_size=module.vocab_size)}


@dataclass(frozen=True)
class PositionEmbedding(Style):
    """A small table looked up whole and added to the residual stream (position or token-type embeddings).

    1D: replicated (the residual stream is whole on every rank). 2D/2.5D/3D: split over the hidden like the
    stream it joins (``HiddenEmbedding2D``)."""

    grid_layer = "hidden_embedding"


@dataclass(frozen=True)
class SequenceParallelNorm(Style):
    """Replicated norm whose grads are summed over TP ranks when the call is sequence-parallel."""

    hf_style = "sequence_parallel"
    grid_layer = "layer_norm"

    def build_1d(self, module, context):
        return SequenceParallelLayerNorm.from_plain(module, context.tp_group, fused=context.config.fused_ops)


@dataclass(frozen=True)
class TPDropout(Style):
    """Dropout on TP-split activations (``always_split``) or on the residual stream (split only under SP)."""

    always_split: bool = False
    hf_style = None

    def build_1d(self, module, context):
        # 2D/2.5D/3D: every activation differs per rank (split over batch and hidden), so every dropout draws from
        # the rank's own stream.
        always_split = self.always_split or context.is_grid
        return ParallelDropout.from_plain(module, context.tp_group, rng=context.rng, always_split=always_split)


@dataclass(frozen=True)
class GridReplicated(Style):
    """A replicated module that runs on whole tokens inside a block that gathers them (an MoE block's router and
    shared-expert gate): unchanged under 1D; under 2D / 2.5D its weight gradients are summed over the grid's batch
    groups (``grid_batch_replicated``)."""

    def build_1d(self, module, context):
        return grid_batch_replicated(module, context, f"{type(module).__name__} (replicated on whole tokens)")


@dataclass(frozen=True)
class StreamLinear(Style):
    """A hidden -> hidden linear outside the tensor-parallel regions (e.g. BERT's MLM transform): replicated under
    1D, where the residual stream is whole; a grid linear under 2D/2.5D/3D, where the stream is split."""

    grid_layer = "stream_linear"


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
        if context.is_grid:  # the model boundary keeps HF's full-batch layout (see grid_boundary.py)
            grid_boundary.check_fully_planned(model, context.tensor_parallel_mode)
            grid_boundary.install(model, context)

    def shard_spec(self, model: nn.Module, param_name: str) -> Layout:
        """The ``Layout`` of a parameter of ``model`` by its full name (``REPLICATED`` when unplanned)."""
        module_name, _, leaf = param_name.rpartition(".")
        style = self.style_for(module_name)
        if style is None:
            return REPLICATED
        return style.shard_specs(model.get_submodule(module_name)).get(leaf, REPLICATED)

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
