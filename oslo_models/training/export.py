"""Export a trained model to a plain Hub folder, whatever data-parallel wrapper it is in.

``model.save_pretrained`` gathers tensor-parallel shards through the plan; under ZeRO-2/3 (FSDP2) every parameter is
additionally split over dp, so it is first gathered over dp into a plain copy of the model (FSDP's own unsharded
parameters are views into its all-gather buffer, which safetensors cannot write). DDP and ZeRO-1 hold whole
tp-local parameters and need nothing extra.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from .zero import unwrap_model


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """Within the block, FSDP2 parameters are whole tp-local tensors on every dp rank (collective on entry/exit)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2: nothing can be sharded
        yield model
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def plain_copy(model: nn.Module) -> nn.Module:
    """The ``oslo_models`` model inside ``model`` with whole tp-local parameters: the model itself under DDP or
    ZeRO-1; under FSDP2 a new model of the same class and layout filled with the dp-gathered parameters (one
    all-gather over dp per parameter; costs one tp-local copy of the model). Collective: call on every rank."""
    inner = unwrap_model(model)
    if not any(hasattr(p, "full_tensor") for p in inner.parameters()):
        return inner
    dtype = next(inner.parameters()).dtype
    copy = type(inner)._build_empty(inner.config, inner.parallel_context, dtype)
    sources = dict(inner.named_parameters())
    with torch.no_grad():
        for name, param in copy.named_parameters():
            source = sources[name]
            param.copy_(source.full_tensor() if hasattr(source, "full_tensor") else source)
    if inner.can_generate():
        copy.generation_config = inner.generation_config
    return copy


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> None:
    """``save_pretrained`` of the ``oslo_models`` model inside ``model`` (DDP, ZeRO-1, FSDP2). Call on every rank;
    global rank 0 writes a folder plain ``transformers`` loads. A generic model (``transformers``' own class) is
    gathered and written by ``transformers``' ``save_pretrained`` (``generic/saving.py``)."""
    from ..conversion.saving import SAVE_RULE
    from ..distributed.agreement import check_arrival
    from ..generic import is_generic

    if is_generic(unwrap_model(model)):
        from ..generic.saving import save_pretrained as generic_save_pretrained

        return generic_save_pretrained(unwrap_model(model), save_directory, **kwargs)
    check_arrival(unwrap_model(model).parallel_context, "training.save_pretrained", SAVE_RULE)  # before FSDP gathers
    plain_copy(model).save_pretrained(save_directory, **kwargs)


def push_to_hub(model: nn.Module, repo_id: str, **kwargs):
    """Upload the plain Hub folder :func:`save_pretrained` writes (native or generic, any wrapper) from global rank 0
    while the other ranks wait. Call on every rank. Options as ``push_to_hub`` of the native models (``private``,
    ``token``, ``commit_message``, ``revision``, ``max_shard_size``)."""
    from ..generic import is_generic

    if is_generic(unwrap_model(model)):
        from ..generic.saving import push_to_hub as generic_push_to_hub

        return generic_push_to_hub(unwrap_model(model), repo_id, **kwargs)
    return plain_copy(model).push_to_hub(repo_id, **kwargs)
