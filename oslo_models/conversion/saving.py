"""The gathering save (``training.save_pretrained(..., distributed=False)`` only), its atomic writer, and the
rank-0 helpers of both saves.

Every Hub save of a model (``model.save_pretrained`` / ``push_to_hub``, ``om.training.save_pretrained`` /
``push_to_hub``) goes through the distributed writer (``model_export.save_hub_folder``: every rank writes its
share, nothing gathered). What is here is the explicit opt-out kept as the benchmarks' and tests' negative control,
and ``model.full_state_dict()``:

``gather_full_state_dict``: every parameter is reassembled over its tensor-parallel group with the plan's
``Layout.gather_local`` (all-gather; padding stripped; packed q|k|v re-interleaved). Only the data-parallel replica
0 gathers (the other replicas hold the same values), and only global rank 0 keeps the result, on CPU.

``write_hub_folder``: rank 0 writes safetensors shards (``huggingface_hub.split_torch_state_dict_into_shards``),
the index, ``config.json`` and ``generation_config.json`` into a staging sibling folder, fsyncs them and swaps it
in atomically (``conversion.atomic.publish_dir``): at every instant the target names a complete folder, the old
one or the new one. Other files already in the folder (a tokenizer, a README) are carried over; stale weight
shards and indexes of another shard layout are not (the distributed writer carries them over the same way).

Every rank must call either save: each first checks that all ranks arrived (a store-based barrier with a timeout,
``distributed.agreement.check_arrival``), so ``if rank == 0: model.save_pretrained(...)`` is a clear error within
seconds naming ``SAVE_RULE`` instead of a collective waiting forever; a write that fails on any rank is raised on
every rank (``run_on_main_process`` / ``agree_on_failure``).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..distributed.agreement import agree_on_failure, check_arrival
from ..distributed.context import ParallelContext
from .atomic import make_staging_dir, publish_dir, recover_folder, remove_stale_staging

SAVE_RULE = ("every rank calls model.save_pretrained() / push_to_hub() / full_state_dict() (every rank writes "
             "its share of the files; full_state_dict gathers the tensor-parallel pieces from all ranks): do not "
             "guard it with `if rank == 0:`")
_WEIGHT_FILE_PREFIXES = ("model.safetensors", "model-", "pytorch_model", "config.json", "generation_config.json")


def gather_full_state_dict(model: torch.nn.Module, *, plan, context: ParallelContext,
                           skip_keys: set[str] = frozenset()) -> dict[str, torch.Tensor] | None:
    """Full-size CPU state dict on global rank 0 (``None`` elsewhere). Collective over each TP group (and, for
    stacked expert weights, each expert-parallel group: all ranks of expert-data-parallel replica 0 take part)."""
    check_arrival(context, "save_pretrained", SAVE_RULE)
    if context.edp_rank != 0:  # edp is dp at expert_parallel_size 1
        return None
    # Each stage's tp rank 0 keeps its stage's tensors; at pipeline_parallel_size == 1 that is global rank 0.
    keep = context.tp_rank == 0 and context.dp_rank == 0 and context.cp_rank == 0  # cp ranks: replicas
    full_state = {} if keep else None
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in skip_keys or id(tensor) in seen:
            continue  # tied weights are saved once, under the name transformers keeps
        seen.add(id(tensor))
        full = plan.shard_spec(model, name).gather_local(tensor.detach(), context)
        if keep:
            full_state[name] = full.to("cpu", copy=True).contiguous()
    if context.pp_size > 1:  # pipeline stages hold disjoint tensors: merge them on global rank 0
        from ..pipeline.checkpoint import collect_stage_state_dicts

        return collect_stage_state_dicts(full_state, context)
    return full_state


def _carry_over_files(save_directory: str, staging: str) -> None:
    """Copy files the user keeps next to the weights (tokenizer, README...) into the new folder."""
    for entry in os.listdir(save_directory):
        if entry.startswith(_WEIGHT_FILE_PREFIXES) or os.path.exists(os.path.join(staging, entry)):
            continue
        source = os.path.join(save_directory, entry)
        target = os.path.join(staging, entry)
        if os.path.isdir(source):
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)


def write_hub_folder(save_directory: str | os.PathLike, state_dict: dict[str, torch.Tensor], *, config,
                     generation_config=None, max_shard_size: str | int = "5GB") -> None:
    """Write a plain Hub folder (safetensors + index + configs) atomically. Call on one process only."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    save_directory = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(save_directory):
        raise ValueError(f"save_directory {save_directory!r} is a file, not a folder")
    recover_folder(save_directory)  # a crash between the fallback renames of an earlier save left it aside
    remove_stale_staging(save_directory)  # what killed saves left (one model's size each)
    staging = make_staging_dir(save_directory)
    try:
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
        for filename, keys in split.filename_to_tensors.items():
            shard = {key: state_dict[key] for key in keys}
            save_file(shard, os.path.join(staging, filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {**split.metadata, "total_size": sum(t.numel() * t.element_size()
                                                                     for t in state_dict.values())},
                     "weight_map": split.tensor_to_filename}
            with open(os.path.join(staging, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
                json.dump(index, handle, indent=2, sort_keys=True)
        config.save_pretrained(staging)
        if generation_config is not None:
            generation_config.save_pretrained(staging)
        if os.path.isdir(save_directory):
            _carry_over_files(save_directory, staging)
        publish_dir(staging, save_directory)  # fsyncs, then one atomic swap
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def run_on_main_process(context: ParallelContext, fn, *args, what: str | None = None, **kwargs):
    """Run ``fn`` on global rank 0 while the others wait; an error there is raised on every rank (no hang).

    Collective: one ``all_gather_object`` (``distributed.agreement``) after ``fn``."""
    result, error = None, None
    if context.rank == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as caught:  # re-raised below on every rank
            error = caught
    agree_on_failure(context, error, what=what or getattr(fn, "__name__", "a step on rank 0"))
    return result


def save_gathered(model: torch.nn.Module, save_directory, *, max_shard_size: str | int = "5GB") -> None:
    """The gathering save of a native model (``training.save_pretrained(..., distributed=False)``): every tensor
    whole on global rank 0 (``model.full_state_dict()``), which writes the folder with :func:`write_hub_folder`.
    ``model``: whole tp-local parameters (not FSDP2-sharded: ``training.export.plain_copy``). Collective."""
    import copy

    full_state = model.full_state_dict()
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    dtypes = {tensor.dtype for tensor in (full_state or {}).values() if tensor.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = dtypes.pop()
    generation_config = model.generation_config if model.can_generate() else None
    run_on_main_process(model.parallel_context, write_hub_folder, save_directory, full_state, config=config,
                        generation_config=generation_config, max_shard_size=max_shard_size,
                        what="save_pretrained (writing on rank 0)")
    model.parallel_context.barrier()
