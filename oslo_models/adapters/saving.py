"""Saving ``peft`` adapters of a parallel model: one plain ``peft`` folder from every rank's pieces, at any layout.

Without pipeline parallelism the standard call works: every rank calls ``model.save_pretrained(folder,
is_main_process=rank == 0)``; the state dict of each LoRA layer holds its adapters full (``lora.py``'s
``_gather_adapters_hook``: tensor-parallel pieces joined, ZeRO-3 shards all-gathered), so ``peft`` writes plain full
tensors.

Under pipeline parallelism it cannot: ``peft`` (``get_peft_model_state_dict``) keeps the state-dict entries under
the LoRA layers it finds among the model's *modules*, and a rank holds only its stage's layers, so whatever the state
dict holds, ``peft`` would write this stage's adapters alone: a partial adapter, which ``peft`` loads with a mere
warning about missing keys (those layers keep their base weights). So an ``oslo_models`` model split into stages refuses
``get_peft_model_state_dict`` (``PeftModel.save_pretrained`` and the trainers' adapter exports call it): a state-dict
pre-hook raises ``NotImplementedError`` naming :func:`save_adapter`, on every rank, before any collective and before
any weight file is written. The same hook makes a rank that takes the state dict alone (``if rank == 0:
model.save_pretrained(...)`` at tp > 1 or ZeRO-3) fail with the rule instead of hanging in the adapters' gather.
:func:`save_adapter` (every rank, any layout) collects every stage's adapters on rank 0
(one ``gather_object`` over the pipeline group of rank 0, after the tp gathers inside each stage) and writes the folder
atomically: staged in a sibling folder, fsynced, then swapped in (``conversion.atomic.publish_dir``).
"""
from __future__ import annotations

import os
import shutil
import sys

import torch
from peft import PeftModel
from torch import nn

from ..conversion.atomic import make_staging_dir, publish_dir, recover_folder, remove_stale_staging
from ..conversion.saving import run_on_main_process
from ..distributed.agreement import check_arrival
from ..utils.training_state import training_state, update_training_state

SAVE_RULE = ("every rank calls adapters.save_adapter() / adapter_state_dict() (the adapters are gathered over the "
             "tensor-parallel ranks, then rank 0 alone writes): do not guard it with `if rank == 0:`")
PIPELINE_SAVE_RULE = (
    "peft's get_peft_model_state_dict (PeftModel.save_pretrained, the trainers' adapter export) at "
    "pipeline_parallel_size={pp} would save only this rank's pipeline stage: peft keeps the entries of the LoRA "
    "layers it finds among the model's modules, and each rank holds only its stage's layers (a partial adapter, which "
    "peft loads with a mere warning). Call oslo_models.adapters.save_adapter(model, folder) on every rank instead: it "
    "collects every stage's adapters (gathered over tensor parallelism) and rank 0 writes one complete plain peft "
    "folder")


def _inside_peft_export() -> bool:
    """Whether this call runs inside ``peft.utils.get_peft_model_state_dict`` (the caller's stack, read only)."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    code = get_peft_model_state_dict.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


STATE_DICT_RULE = ("every rank takes the state dict of a model with adapters split over tensor parallelism or "
                   "sharded by ZeRO-3 (its LoRA layers gather their adapters, a collective): call "
                   "model.save_pretrained(folder, is_main_process=rank == 0) on every rank, never under "
                   "`if rank == 0:`")


def _gathers_adapters(module: nn.Module) -> bool:
    """Whether taking ``module``'s state dict runs the adapters' collective: it holds LoRA layers (not after
    ``merge_and_unload``, when the model's own save gathers on its own terms), split over tp or sharded by ZeRO-3."""
    from .lora import ParallelLoraLinear

    if not any(isinstance(m, ParallelLoraLinear) for m in module.modules()):
        return False
    return module.parallel_context.tp_size > 1 or any(hasattr(p, "full_tensor") for p in module.parameters())


def _check_export(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """State-dict pre-hook of a model with adapters, before any collective: a pipelined model refuses ``peft``'s
    own export (see the module docstring), and a state dict that gathers adapters first checks that every rank
    takes it (``check_arrival``: a rank alone gets a ``RuntimeError`` naming the rule, not a hang)."""
    context = module.parallel_context
    if context.pp_size > 1 and _inside_peft_export():
        raise NotImplementedError(PIPELINE_SAVE_RULE.format(pp=context.pp_size))
    if _gathers_adapters(module):
        check_arrival(context, "adapter_state_dict", STATE_DICT_RULE)


def guard_adapter_export(model: nn.Module) -> None:
    """Install :func:`_check_export` on a parallel model (once; ``peft`` sets ``peft_config`` per adapter)."""
    context = getattr(model, "parallel_context", None)
    if context is None or context.world_size == 1 or training_state(model).adapter_export_guard is not None:
        return
    update_training_state(model, adapter_export_guard=model.register_state_dict_pre_hook(_check_export))


def _context_of(model: nn.Module):
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    context = getattr(inner, "parallel_context", None)
    if context is None:
        raise TypeError(f"{type(inner).__name__} is not an oslo_models model (no parallel_context)")
    return context


def adapter_state_dict(model: PeftModel) -> dict[str, torch.Tensor] | None:
    """The full adapter tensors (``peft``'s key names, adapter name included) on global rank 0, ``None`` elsewhere.

    Collective: call on every rank. ``model.state_dict()`` already holds this stage's adapters full (ZeRO-3 shards
    all-gathered over data parallelism, tensor-parallel pieces joined by their ``Layout``: ``_gather_adapters_hook``);
    pipeline stages send theirs to rank 0."""
    context = _context_of(model)
    check_arrival(context, "save_adapter", SAVE_RULE)
    keep = context.tp_rank == 0 and context.dp_rank == 0
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():  # the adapters come gathered (_gather_adapters_hook)
        if "lora_" not in key and "modules_to_save" not in key:
            continue
        tensor = tensor.detach()
        if hasattr(tensor, "full_tensor"):  # a ZeRO-3 (FSDP2) DTensor outside the LoRA layers (modules_to_save)
            tensor = tensor.full_tensor()
        if keep:
            out[key] = tensor.to("cpu", copy=True).contiguous()
    if context.pp_size > 1:  # stages hold disjoint adapters: merge them on global rank 0
        from ..pipeline.checkpoint import collect_stage_state_dicts

        return collect_stage_state_dicts(out if keep else None, context)
    return out if context.rank == 0 else None


def save_adapter(model: PeftModel, save_directory: str | os.PathLike, **kwargs) -> None:
    """Write a plain ``peft`` adapter folder (``adapter_config.json`` + ``adapter_model.safetensors`` of full
    tensors, every pipeline stage's) that ``peft.PeftModel.from_pretrained`` opens on any model, parallel or not.
    Call on every rank: the adapters are gathered (``adapter_state_dict``) and rank 0 writes through
    ``PeftModel.save_pretrained`` into a staging folder swapped in at once. ``kwargs`` go to ``save_pretrained``."""
    from ..training.zero import unwrap_model

    model = unwrap_model(model)
    context = _context_of(model)
    full = adapter_state_dict(model)
    run_on_main_process(context, _write_adapter, model, save_directory, full, context.pp_size > 1,
                        what="save_adapter (writing on rank 0)", **kwargs)
    context.barrier()


def _write_adapter(model: PeftModel, save_directory, full: dict[str, torch.Tensor], all_stages: bool,
                   **kwargs) -> None:
    """``PeftModel.save_pretrained`` on rank 0, into a staging copy of the folder (``peft`` updates a folder in
    place: its README, other adapters' subfolders stay), published atomically. Under pipeline parallelism ``peft``
    keeps only the adapters of the modules rank 0 holds (its stage), so each adapter's weights file is then rewritten
    with every stage's tensors, in ``peft``'s format (adapter name dropped from the keys,
    ``adapter_model.safetensors``, format ``pt``), before the folder appears."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    save_directory = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(save_directory):
        raise ValueError(f"save_directory {save_directory!r} is a file, not a folder")
    recover_folder(save_directory)  # a crash between publish_dir's fallback renames left the old folder aside
    remove_stale_staging(save_directory)
    staging = make_staging_dir(save_directory)
    try:
        if os.path.isdir(save_directory):
            shutil.copytree(save_directory, staging, dirs_exist_ok=True)
        model.save_pretrained(staging, state_dict=full, is_main_process=True, **kwargs)
        if all_stages:
            for name in kwargs.get("selected_adapters") or list(model.peft_config):
                folder = staging if name == "default" else os.path.join(staging, name)
                tensors = {key.replace(f".{name}.", "."): tensor for key, tensor in full.items()
                           if "lora_" in key and f".{name}." in key}
                save_file(tensors, os.path.join(folder, SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
        publish_dir(staging, save_directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
