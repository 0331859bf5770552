"""The gathering save of a generic model: ``om.training.save_pretrained(model, folder, distributed=False)`` only.

Every Hub save of a generic model (``om.training.save_pretrained`` / ``push_to_hub``) goes through the distributed
writer (``conversion/model_export.py``: every rank writes its share, nothing gathered), the same as native models;
this is the explicit opt-out kept as the benchmarks' and tests' negative control (``transformers``' own files).

Every rank gathers each tensor whole (``DTensor.full_tensor``: an all-gather over the tensor's mesh, tp and/or dp;
plain tensors are already whole), one tensor at a time; global rank 0 keeps them on CPU. Rank 0 then writes them
with ``transformers``' own ``save_pretrained`` of a meta-device twin of the model (``state_dict=`` the gathered
tensors): the files are exactly what ``transformers`` writes for the type (its key renames reversed, tied weights
once, ``config.json`` / ``generation_config.json``). The folder is written into a staging sibling and swapped in
atomically (``conversion/atomic.py``), keeping the user's other files (a tokenizer) as the native saver does.

Collective: call on every rank (a store-based arrival check first, then the gathers, then an agreement on rank 0's
write).
"""
from __future__ import annotations

import copy
import os
import shutil

import torch
from torch import nn


def full_state_dict(model: nn.Module, context) -> dict[str, torch.Tensor] | None:
    """Every tensor of ``model.state_dict()`` whole, on CPU, on global rank 0 (``None`` elsewhere)."""
    keep = context.rank == 0
    state, gathered = ({} if keep else None), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in gathered:  # a tied pair is gathered once
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            gathered[id(tensor)] = full.detach().to("cpu", copy=True).contiguous() if keep else None
        if keep:
            state[name] = gathered[id(tensor)]
    return state


def _write(model_class, config, generation_config, state, save_directory: str, max_shard_size) -> None:
    """Rank 0: ``transformers``' ``save_pretrained`` of a meta twin, into a staging folder swapped in atomically."""
    from ..conversion.atomic import make_staging_dir, publish_dir, recover_folder, remove_stale_staging
    from ..conversion.saving import _carry_over_files

    save_directory = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(save_directory):
        raise ValueError(f"save_directory {save_directory!r} is a file, not a folder")
    recover_folder(save_directory)
    remove_stale_staging(save_directory)
    with torch.device("meta"):
        twin = model_class._from_config(config)  # only its structure is used: the tensors are `state`
    if generation_config is not None:
        twin.generation_config = generation_config
    staging = make_staging_dir(save_directory)
    try:
        twin.save_pretrained(staging, state_dict=state, max_shard_size=max_shard_size)
        if os.path.isdir(save_directory):
            _carry_over_files(save_directory, staging)
        publish_dir(staging, save_directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def save_pretrained(model: nn.Module, save_directory, *, max_shard_size: str | int = "5GB") -> None:
    """Write a plain Hub folder of ``model`` that ``transformers`` loads as is. Call on every rank."""
    from ..conversion.saving import SAVE_RULE, run_on_main_process
    from ..distributed.agreement import check_arrival

    context = model.parallel_context
    check_arrival(context, "training.save_pretrained", SAVE_RULE)  # before the gathers
    state = full_state_dict(model, context)
    config = copy.deepcopy(model.config)
    if hasattr(config, "distributed_config"):
        del config.distributed_config
    dtypes = {tensor.dtype for tensor in (state or {}).values() if tensor.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = dtypes.pop()
    generation_config = model.generation_config if model.can_generate() else None
    run_on_main_process(context, _write, type(model), config, generation_config, state, save_directory,
                        max_shard_size, what="save_pretrained (writing on rank 0)")
    context.barrier()

