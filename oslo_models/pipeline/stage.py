"""Pipeline stages cut out of an unmodified model: each rank keeps only the modules of its own stages.

The model class is not rewritten as ``nn.Sequential``. A small per-family ``PipelineAdapter`` (``adapter.py``)
names the pieces of the existing module tree (the layer containers, the modules each stage runs besides its
layers) and says how one stage runs them. ``keep_stage_modules`` then, while the model is still on the meta device:

- replaces each layer container (``transformer.h``; T5: ``encoder.block`` and ``decoder.block``) by
  ``StageLayers`` holding this rank's layers under their original indices, so parameter names stay the Hub
  names (``transformer.h.5.attn.c_attn.weight``) and loading and saving by name keep working;
- drops (sets to ``None``) the non-layer modules none of this rank's stages runs (embeddings off the first
  stage, final norm and head off the last one).

Tied weights (an input embedding and the output embedding, or T5's embedding shared by encoder and decoder; a
layer module several stages run, as ALBERT's shared layer groups): stages on different ranks hold copies of one
tensor. Every copy is loaded from the same checkpoint tensor; after
each backward their gradients are summed over the ranks holding a copy (``TiedCopies``), so with the same
optimizer they stay equal and equal the single-process tied weight.

A ``StageModule`` is the ``nn.Module`` handed to ``torch.distributed.pipelining.PipelineStage`` for one stage: it
registers only that stage's modules (shared with the model, not copied), so the stage's ``parameters()`` — which
torch uses for the zero-bubble weight-gradient pass — are exactly the stage's own. Under the 2D / 2.5D / 3D
tensor-parallel modes it first cuts the microbatch to this rank's batch block (``grid_boundary``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..utils.training_state import training_state
from .adapter import adapter_for
from .partition import partition_layers, stage_to_rank, stages_of_rank


@dataclass(frozen=True)
class PipelineLayout:
    """Where every stage lives. ``ranges[s]``: layers of stage ``s``; ``local_stages``: this rank's stages."""

    pp_size: int
    virtual_size: int
    ranges: tuple[range, ...]
    local_stages: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def has_first(self) -> bool:
        return 0 in self.local_stages

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.local_stages

    @property
    def last_rank(self) -> int:
        return stage_to_rank(self.num_stages - 1, self.pp_size)

    def local_layers(self) -> list[int]:
        return [layer for stage in self.local_stages for layer in self.ranges[stage]]


class StageLayers(nn.Module):
    """The layers this rank owns, registered under their global index; iterates in index order."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


# ---------------------------------------------------------------------------------------------- pruning
def build_layout(model, context) -> PipelineLayout:
    """Partition ``model``'s layers over ``context``'s pipeline ranks per ``ParallelConfig``."""
    adapter = adapter_for(model)
    config = context.config
    num_stages = context.pp_size * config.virtual_pipeline_size
    costs, first, last = adapter.layer_parameter_counts(model)
    ranges = partition_layers(adapter.num_layers(model), num_stages, config.pipeline_partition, layer_costs=costs,
                              first_extra=first, last_extra=last)
    return PipelineLayout(context.pp_size, config.virtual_pipeline_size, tuple(ranges),
                          tuple(stages_of_rank(context.pp_rank, context.pp_size, config.virtual_pipeline_size)))


def _set_module(model, path: str, module) -> None:
    owner_name, _, attr = path.rpartition(".")
    setattr(model.get_submodule(owner_name) if owner_name else model, attr, module)


def keep_stage_modules(model, context) -> PipelineLayout:
    """Drop every module this rank's stages do not run (call on the meta device, before allocation)."""
    adapter = adapter_for(model)
    layout = build_layout(model, context)
    layer_ids = adapter.layer_ids(model)
    local = [layer_ids[i] for i in layout.local_layers()]
    for path in adapter.layer_paths:
        container = model.get_submodule(path)
        _set_module(model, path, StageLayers({index: container[index] for p, index in local if p == path}))
    needed = {path for stage in layout.local_stages for path in adapter.stage_modules(model, layout, stage).values()}
    for path in sorted(adapter.optional_modules(model, layout) - needed):
        _set_module(model, path, None)
    model.pipeline_layout = layout
    return layout


class StageModule(nn.Module):
    """One pipeline stage over shared modules of ``model``: registers only this stage's parameters.

    ``layers``: the stage's layers in execution order (``layer_ids`` gives each one's container and index);
    the adapter's ``stage_modules`` are attributes. ``forward(*inputs, **kwargs)`` is the adapter's
    ``stage_forward``: the first stage takes the batch's ``first_inputs``, the others the previous stage's outputs.

    Mixed precision (``om.training.prepare`` with Accelerate's ``mixed_precision="bf16"``/``"fp16"`` sets the
    model's ``training_state(model).autocast_dtype``; or the caller's ``torch.autocast`` around ``train_step``): the
    stage runs under ``torch.autocast`` here, inside the schedule, where the
    Accelerate wrapper of ``model.forward`` never reaches; its floating outputs are cast back to the parameters'
    dtype, the dtype the schedule's point-to-point buffers were declared with.
    """

    def __init__(self, model, stage: int, layout: PipelineLayout, *, sequence_parallel: bool):
        super().__init__()
        self.adapter = adapter_for(model)
        self.stage_index = stage
        self.is_first, self.is_last = stage == 0, stage == layout.num_stages - 1
        self.sequence_parallel = sequence_parallel
        # Plain attributes (not submodules): the config, context and layout are shared, not parameters.
        object.__setattr__(self, "model_config", model.config)
        object.__setattr__(self, "parallel_context", model.parallel_context)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "owner", model)  # read at forward time: prepare() may set autocast later
        all_ids = self.adapter.layer_ids(model)
        self.layer_ids = [all_ids[i] for i in layout.ranges[stage]]
        self.layers = nn.ModuleList([model.get_submodule(path)[index] for path, index in self.layer_ids])
        for attribute, path in self.adapter.stage_modules(model, layout, stage).items():
            setattr(self, attribute, model.get_submodule(path))

    def forward(self, *inputs, **kwargs):
        if self.parallel_context.is_grid:
            # 2D / 2.5D / 3D: the schedule hands every rank the whole microbatch; keep this rank's batch block.
            from ..parallel_layers.grid_boundary import split_stage_inputs

            names = self.adapter.first_inputs if self.is_first else ()
            inputs, kwargs = split_stage_inputs(self.owner, names, inputs, kwargs)
        autocast_dtype = training_state(self.owner).autocast_dtype
        device_type = self.parallel_context.device.type
        if autocast_dtype is None and not torch.is_autocast_enabled(device_type):
            return self.adapter.stage_forward(self, *inputs, **kwargs)
        # prepare's autocast, or the caller's around train_step (torch's AMP recipe): either way the outputs go
        # back to the parameters' dtype below
        with torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
            outputs = self.adapter.stage_forward(self, *inputs, **kwargs)
        dtype = next(self.owner.parameters()).dtype
        cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(cast(t) for t in outputs) if isinstance(outputs, tuple) else cast(outputs)


# ---------------------------------------------------------------------------------------------- tied weights
def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def ranks_holding(model, layout: PipelineLayout, names: tuple[str, ...]) -> list[int]:
    """Pipeline ranks whose stages hold a copy of any parameter in ``names``: a parameter of one of the stage's
    non-layer modules, or one inside one of its layers (a layer module run on several stages: ALBERT's shared
    groups)."""
    adapter = adapter_for(model)
    owners = {_module_of(name) for name in names}
    layer_ids = adapter.layer_ids(model)
    ranks = set()
    for stage in range(layout.num_stages):
        paths = set(adapter.stage_modules(model, layout, stage).values())
        layers = {f"{layer_ids[i][0]}.{layer_ids[i][1]}." for i in layout.ranges[stage]}
        if owners & paths or any(owner.startswith(layer) for owner in owners for layer in layers):
            ranks.add(stage_to_rank(stage, layout.pp_size))
    return sorted(ranks)


class TiedCopies:
    """The copies of tied parameters across pipeline ranks, and the process groups that sum their gradients.

    Collective at construction: every rank calls ``new_group`` for every tied group and every (dp, tp)
    coordinate in the same order (torch requires it). ``groups``: ``(this rank's parameter, process group)``
    for each tied group with copies on several pipeline ranks, including this one.
    """

    def __init__(self, model, layout: PipelineLayout, context):
        self.groups: list[tuple[nn.Parameter, object]] = []
        local = dict(model.named_parameters(remove_duplicate=False))
        # [pp, dp (x cp), tp] global ranks; 2D/2.5D/3D: tp's grid sub-axes flattened into the last dim
        mesh = context.mesh.mesh.reshape(context.pp_size, -1, context.tp_size)
        by_ranks: dict[tuple[int, ...], object] = {}  # one process group per set of pipeline ranks (ALBERT: many
        # tied parameters, the same ranks), made in the same order on every rank
        for names in adapter_for(model).tied_groups(model):
            pp_ranks = ranks_holding(model, layout, names)
            if len(pp_ranks) < 2:
                continue  # one rank holds every copy: they are one Parameter there already
            if tuple(pp_ranks) not in by_ranks:
                mine = None
                for dp in range(mesh.shape[1]):
                    for tp in range(mesh.shape[2]):
                        ranks = [int(mesh[pp, dp, tp]) for pp in pp_ranks]
                        group = dist.new_group(ranks)
                        if context.rank in ranks:
                            mine = group
                by_ranks[tuple(pp_ranks)] = mine
            mine = by_ranks[tuple(pp_ranks)]
            params = {id(local[name]): local[name] for name in names if name in local}
            if mine is not None and params:
                if len(params) > 1:
                    raise RuntimeError(f"Tied parameters {names} are distinct tensors on one rank; tie them first")
                self.groups.append((next(iter(params.values())), mine))

    def sum_gradients(self) -> None:
        """All-reduce (sum) each tied copy's gradient over the ranks holding a copy."""
        for param, group in self.groups:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            if hasattr(grad, "to_local"):
                if grad.placements != param.placements:
                    # a DTensor gradient may come back laid out otherwise than its parameter (the generic path's
                    # vocabulary-split tied embedding: replicated or partial over tp); the copies' local pieces
                    # must be alike: the parameter's layout (collective over the gradient's mesh)
                    grad = param.grad = grad.redistribute(grad.device_mesh, param.placements)
                # ZeRO-2/3: every copy is sharded alike over dp (same shape, same dp mesh): sum the local shards
                grad = grad.to_local()
            dist.all_reduce(grad, group=group)


def tied_duplicates(model) -> set[str]:
    """This rank's parameter names that are copies of a tied tensor also held by a lower pipeline rank.

    Whatever counts each tensor once over the whole model (the gradient norm) skips these: the copy on the lowest
    pipeline rank holding the group stands for all of them (their gradients are equal after ``sum_gradients``).
    """
    layout = getattr(model, "pipeline_layout", None)
    if layout is None:
        return set()
    pp_rank = model.parallel_context.pp_rank
    local = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    duplicates = set()
    for names in adapter_for(model).tied_groups(model):
        pp_ranks = ranks_holding(model, layout, names)
        if len(pp_ranks) > 1 and pp_rank != pp_ranks[0]:
            duplicates |= local & set(names)
    return duplicates
