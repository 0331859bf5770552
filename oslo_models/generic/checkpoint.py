"""Training checkpoints of generic models: the tensors ``training.save_checkpoint`` / ``load_checkpoint`` store.

``training/checkpoint.py`` does everything but choosing the tensors (folders, trainer state, RNG, agreement); for a
generic model it asks this module instead of the model's plan. A generic model's parameters say their own layout:
DTensors (tensor parallel over ``tp``, FSDP2 over ``dp``, or both) or plain tensors (replicas). They go to DCP as
they are, under the same keys as native models (``model/<name>``, ``optim/<name>/<state key>``): DCP stores each
element once, with the global shape, and on load reads for every rank of the new layout just what it holds, so a
checkpoint resumes at another tp, dp or ZeRO stage with no conversion.

One layout DCP cannot describe as a box of the global tensor: ``transformers``' packed styles shard a tensor
holding several equal blocks (gate|up) block by block (``_StridedShard(dim, split_factor=k)``). Such a parameter
(known from the model's plan, at any tp) is stored through a view that splits ``dim`` into ``(k, dim / k)``: in it
the rank's piece is ``Shard(dim + 1)``, a box again (no communication; the same trick as the native plan's packed
q|k|v), and a checkpoint of it has the same entries at tp 1 and tp 2.

Pipeline stages (``pipeline_stage.py``) hold disjoint parameters, so their entries are disjoint and carry the Hub
names a pp = 1 model has; a tied pair held by two stages (the first stage's embedding, the last stage's head) is
written once, under the name of the copy the lowest pipeline rank holds (the embedding's: the name a pp = 1 model
keeps, ``named_parameters`` listing a tied tensor once), and a stage whose copy has another name reads it and its
optimizer state from there (``aliases``). So pp 2 x dp 2 resumes at dp 4 and back, at any ZeRO stage or tp.

Optimizer state is saved by the ranks that hold it (all of them, or under ZeRO-1 the owner of each parameter) and
restored into the state of this layout's holders, created at the parameter's layout.
"""
from __future__ import annotations

import torch
from torch import nn


def packed_parameters(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{name: (tensor dim, number of blocks)}`` of the parameters ``transformers``' plan packs (``packed_colwise``
    / ``packed_rowwise``), whatever the tensor-parallel size (the checkpoint must not depend on it)."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, _get_parameter_plan
    from transformers.distributed.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel

    plan = dict(getattr(model, "tp_plan", None) or {})
    found = {}
    for name, param in model.named_parameters():
        style_name = _get_parameter_plan(name, plan) if plan else None
        style = ALL_PARALLEL_STYLES[style_name] if style_name in ALL_PARALLEL_STYLES else None
        if isinstance(style, PackedColwiseParallel):
            found[name] = (style._packed_output_shard_dim(param.dim()) % param.dim(), style.split_factor)
        elif isinstance(style, PackedRowwiseParallel) and param.dim() > 1:
            found[name] = (param.dim() - 1, style.split_factor)
    return found


def _splits(placement) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)  # _StridedShard is no Shard subclass


def dcp_value(tensor: torch.Tensor, packed: tuple[int, int] | None) -> torch.Tensor:
    """``tensor`` as DCP stores it: itself, or for a packed parameter (``(dim, blocks)``) and its optimizer state
    the view splitting ``dim`` into ``(blocks, dim / blocks)`` - in which the packed styles' strided shard is a
    ``Shard(dim + 1)`` box - at every layout. A view of the same storage: loading into it fills ``tensor``."""
    if packed is None:
        return tensor
    dim, factor = packed
    if not hasattr(tensor, "placements"):
        return tensor.unflatten(dim, (factor, tensor.shape[dim] // factor))
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ndim, placements = tensor.dim(), []
    for p in tensor.placements:
        if isinstance(p, _StridedShard) and p.dim % ndim == dim and p.split_factor == factor:
            placements.append(Shard(dim + 1))  # the packed style's split: block by block
        elif _splits(p) and p.dim % ndim == dim:
            raise NotImplementedError(f"a packed tensor with placements {tensor.placements} (split along its "
                                      f"packed dim {dim} by something else than its packed style) cannot be "
                                      f"checkpointed")
        elif _splits(p):
            moved = p.dim % ndim + (p.dim % ndim > dim)
            placements.append(_StridedShard(moved, split_factor=p.split_factor) if isinstance(p, _StridedShard)
                              else Shard(moved))
        else:
            placements.append(p)
    local = tensor._local_tensor
    view = local.unflatten(dim, (factor, local.shape[dim] // factor))
    shape = (*tensor.shape[:dim], factor, tensor.shape[dim] // factor, *tensor.shape[dim + 1:])
    return DTensor.from_local(view, tensor.device_mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _holders(optimizer) -> list:
    """The optimizers holding this rank's state (ZeRO-1 keeps its own part in ``.optim``)."""
    if optimizer is None:
        return []
    parts = [inner for inner, _ in optimizer.inner] if hasattr(optimizer, "inner") else [optimizer]
    found = []
    for part in parts:
        holder = part.optim if hasattr(part, "optim") else part  # None: a ZeRO-1 rank owning nothing
        if holder is not None:
            found.append(holder)
    return found


def _holder_of(optimizer, param):
    for holder in _holders(optimizer):
        if any(param is p for group in holder.param_groups for p in group["params"]):
            return holder
    return None


def state_to_save(model: nn.Module, optimizer) -> dict:
    """The DCP state dict of ``model`` and this rank's part of ``optimizer``'s state. Copies of a tied tensor on
    higher pipeline ranks are left out (the lowest rank's copy stands for them)."""
    from ..pipeline.stage import tied_duplicates

    state, packed = {}, packed_parameters(model)
    duplicates = tied_duplicates(model)
    params = {name: param for name, param in model.named_parameters() if name not in duplicates}
    for name, param in params.items():
        state[f"model/{name}"] = dcp_value(param.detach(), packed.get(name))
    all_param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, buffer in model.state_dict().items():
        if name not in all_param_names:  # persistent buffers: replicated
            state[f"model/{name}"] = buffer.detach()
    for name, param in params.items():
        holder = _holder_of(optimizer, param)
        for key, value in (holder.state.get(param, {}) if holder is not None else {}).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"optimizer state {name}/{key} is not a tensor ({type(value).__name__}); only "
                                 "tensor optimizer state can be checkpointed")
            state[f"optim/{name}/{key}"] = dcp_value(value.detach(), packed.get(name) if value.dim() else None)
    return state


def _check_shape(key: str, metadata, expected) -> None:
    if key not in metadata:
        raise ValueError(f"the checkpoint has no entry {key!r}: it was saved from another model")
    saved = tuple(metadata[key].size)
    if saved != tuple(expected):
        raise ValueError(f"{key}: the checkpoint holds shape {saved}, this model needs {tuple(expected)}: another "
                         "model config")


def load_targets(path: str, model: nn.Module, optimizer, metadata, aliases: dict | None = None) -> tuple[dict, list]:
    """``(state, pending)`` for ``training.load_checkpoint``: DCP loads the parameters and buffers in place; each
    pending entry's ``apply`` installs a loaded optimizer-state tensor in its holder. ``aliases``: ``{parameter
    name: stored name}`` of this rank's tied copies stored under another name of their group (a last stage's head
    read from the embedding's entry)."""
    state, pending, packed = {}, [], packed_parameters(model)
    aliases = aliases or {}
    params = dict(model.named_parameters())
    for name, param in params.items():
        key = f"model/{aliases.get(name, name)}"
        state[key] = target = dcp_value(param.detach(), packed.get(name))
        _check_shape(key, metadata, target.shape)
    all_param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, buffer in model.state_dict().items():
        if name not in all_param_names and f"model/{name}" in metadata:
            state[f"model/{name}"] = buffer.detach()
    for name, param in params.items():
        holder = _holder_of(optimizer, param)
        if holder is None:  # ZeRO-1: another dp rank holds this parameter's state
            continue
        prefix = f"optim/{aliases.get(name, name)}/"
        for key in (k for k in metadata if k.startswith(prefix)):
            entry = metadata[key]
            if len(entry.size) == 0:
                value = target = torch.zeros((), dtype=entry.properties.dtype)
            else:
                value = torch.zeros_like(param.detach(), dtype=entry.properties.dtype)
                target = dcp_value(value, packed.get(name))
                _check_shape(key, metadata, target.shape)
            state[key] = target

            def apply(_, holder=holder, param=param, state_key=key[len(prefix):], value=value):
                holder.state.setdefault(param, {})[state_key] = value
            local = target._local_tensor if hasattr(target, "_local_tensor") else target
            pending.append((key, local, local, None, apply))
    return state, pending
