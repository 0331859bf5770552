"""Export a trained model to a plain Hub folder, whatever layout and data-parallel wrapper it is in.

:func:`save_pretrained` writes the folder from every rank at once, each rank the boxes of the tensors it holds
(``conversion/model_export.py`` -> ``conversion/hub_export.py``): no tensor is gathered, for every layout (tp 1D
and grid, pp, ep, ZeRO 1-3, HSDP, NVMe offload; native and generic models alike). It is the same writer as a
native model's own ``model.save_pretrained`` / ``push_to_hub``. ``distributed=False`` keeps the gathering save
(the benchmarks' and tests' negative control): tensor-parallel shards gathered through the plan and rank 0 writes
(``conversion.saving.save_gathered``); under ZeRO-2/3 (FSDP2) every parameter is first gathered over dp into a
plain copy of the model (:func:`plain_copy`); generic models through ``generic/saving.py``.
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


def _save_gathered(model: nn.Module, save_directory, *, max_shard_size) -> None:
    """The gathering save (before issue 53): every tensor whole on global rank 0, which writes the folder."""
    from ..conversion.saving import SAVE_RULE, save_gathered
    from ..distributed.agreement import check_arrival
    from ..utils.model_protocol import protocol_of

    if protocol_of(model).layout == "placements":  # transformers' own save gathers its DTensors
        from ..generic.saving import save_pretrained as generic_save_pretrained

        return generic_save_pretrained(unwrap_model(model), save_directory, max_shard_size=max_shard_size)
    check_arrival(unwrap_model(model).parallel_context, "training.save_pretrained", SAVE_RULE)  # before FSDP gathers
    save_gathered(plain_copy(model), save_directory, max_shard_size=max_shard_size)


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, max_shard_size: str | int = "5GB",
                    buffer_bytes: int | None = None, distributed: bool = True, safe_serialization: bool = True,
                    **kwargs) -> dict | None:
    """Write a plain Hub folder of the model inside ``model`` (native or generic; DDP, ZeRO-1/2/3, HSDP, NVMe
    offload, pipeline stages, experts) that plain ``transformers`` loads. Call on every rank.

    ``distributed=True`` (default): every rank writes the boxes of each tensor it holds straight into the shard
    files (``conversion/hub_export.py``); nothing is gathered, no rank holds more than its own parameters plus a
    host buffer of ``buffer_bytes`` (default 256 MiB), and the ranks share the writing (about ``1/N`` of the bytes
    each); rank 0 writes the index and configs and swaps the folder in atomically. Every rank must see the folder
    on the same file system. Returns this rank's ``{"bytes", "planned_bytes", "seconds"}``.
    ``distributed=False``: the earlier gathering save (every tensor whole on global rank 0); returns ``None``."""
    from ..conversion.model_export import save_hub_folder

    if safe_serialization is False:
        raise ValueError("save_pretrained(safe_serialization=False) is not supported: oslo-models writes "
                         "safetensors only, as transformers v5 does")
    if kwargs:
        raise ValueError(f"Unknown save_pretrained option(s): {sorted(kwargs)}")
    if not distributed:
        if buffer_bytes is not None:
            raise ValueError("buffer_bytes= applies to the distributed save only (distributed=True)")
        return _save_gathered(model, save_directory, max_shard_size=max_shard_size)
    return save_hub_folder(unwrap_model(model), save_directory, max_shard_size=max_shard_size,
                           buffer_bytes=buffer_bytes, what="training.save_pretrained")


def push_to_hub(model: nn.Module, repo_id: str, *, private: bool | None = None, token=None,
                commit_message: str = "Upload model", revision: str | None = None, max_shard_size: str | int = "5GB",
                buffer_bytes: int | None = None, staging_dir: str | os.PathLike | None = None):
    """Upload the plain Hub folder :func:`save_pretrained` writes (native or generic, any wrapper). Call on every
    rank: every rank writes its share into a staging folder made by global rank 0 (in ``staging_dir``, else its
    temporary folder; every rank must see it, else a ``ValueError`` on every rank before anything is written),
    then rank 0 uploads it while the others wait (``conversion.model_export.push_hub_folder``). Returns the
    upload's result on rank 0, ``None`` elsewhere."""
    from ..conversion.model_export import push_hub_folder

    return push_hub_folder(unwrap_model(model), repo_id, private=private, token=token, commit_message=commit_message,
                           revision=revision, max_shard_size=max_shard_size, buffer_bytes=buffer_bytes,
                           staging_dir=staging_dir)
