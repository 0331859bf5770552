"""A resumable training checkpoint (any layout) -> a plain Hub folder, offline, streamed, in parallel over processes.

``python -m oslo_models checkpoint consolidate CKPT OUT`` (or ``torchrun --nproc-per-node N -m oslo_models checkpoint
consolidate ...``). ``CKPT`` is a ``save_checkpoint`` folder (its newest complete step) or one ``step-N`` folder.
Nothing is rebuilt: DCP's metadata lists every stored chunk (each a box of a tensor in its layout-independent,
row-major shape, so its flat elements are the full tensor's), and ``hub/export.json`` (``training/checkpoint_hub.py``)
says which Hub tensors each entry becomes. The output is planned like a live export (``safetensors_files``: the
same shards, headers and offsets as ``save_pretrained``); the chunks are shared among the processes by bytes, the
largest first; each process reads its chunks one at a time through DCP's own ``FileSystemReader`` (a load planner
that hands each chunk to the writer and lets it go) and ``pwrite``s it where it belongs. Process 0 creates the
staging folder, then writes the index and configs and swaps the folder in atomically, as ``save_pretrained`` does.

Memory per process: one stored chunk at a time (twice: DCP's read and the copy it hands over). A chunk is at most what
one rank held of a tensor when it saved (its tensor-parallel piece; a tensor stored whole, e.g. replicated key/value
heads, is one chunk). A generic tensor ``transformers`` converts on save by more than a rename or a slice (dots1's
fused experts written per expert) is the exception: one process reads it whole and converts it with a meta-device model
of the saved config (``offline_conversion.py``), so the bound there is one whole tensor, as in the live export.
Collectives (several processes): small ``all_gather_object`` agreements over gloo.
"""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np

from ..distributed.agreement import agree_on_failure
from .hub_export import DEFAULT_BUFFER_BYTES, Files, finish, prepare_staging, write_box, write_converted
from .offline_conversion import check_conversions, meta_model, model_shape, torch_dtype
from .safetensors_files import DTYPES_BY_NAME, HubTensor, dtype_name, plan_files


def _step_folder(checkpoint: str) -> str:
    from ..training.checkpoint_folders import describe_missing, find_checkpoint

    folder = find_checkpoint(checkpoint)
    if folder is None:
        raise ValueError(describe_missing(checkpoint))
    return folder


def read_export(folder: str) -> tuple[dict, dict]:
    """``(hub/export.json's tensors, DCP metadata entries)`` of a step folder; ``ValueError`` when unusable."""
    from torch.distributed.checkpoint import FileSystemReader

    from ..training.checkpoint_hub import EXPORT_FILE, HUB_DIR

    path = os.path.join(folder, HUB_DIR, EXPORT_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{folder} has no {HUB_DIR}/{EXPORT_FILE}: it was saved by an oslo_models version older than "
                         "the consolidation tool; load it with load_checkpoint and call training.save_pretrained")
    with open(path, encoding="utf-8") as handle:
        tensors = json.load(handle)["tensors"]
    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    missing = [key for key, value in tensors.items() if (value.get("regions") or "converted" in value)
               and key not in metadata]
    if missing:
        raise ValueError(f"{folder}: the checkpoint lists {missing[:3]} but DCP stored no such entries")
    converted = {key: value["converted"] for key, value in tensors.items() if "converted" in value}
    if converted:
        check_conversions(meta_model(folder), converted, metadata)
    return tensors, metadata


def _plan(tensors: dict, metadata: dict, max_shard_size, world_size: int):
    """``(files, {unit: process})``. A unit is one stored chunk ``(key, offsets, sizes)``, or ``(key, None, None)``
    for a converted tensor, which one process reads whole and converts; units go to processes by bytes, largest
    first."""
    hub, units = [], {}
    for key, value in tensors.items():
        entry = metadata.get(key)
        if "converted" in value:
            hub += [HubTensor(name, tuple(shape), dtype_name(torch_dtype(dtype)))
                    for name, shape, dtype in value["converted"]]
            units[(key, None, None)] = int(np.prod(tuple(entry.size))) * entry.properties.dtype.itemsize
            continue
        if not value["regions"]:
            continue
        dtype = dtype_name(entry.properties.dtype)
        hub += [HubTensor(name, tuple(shape), dtype) for name, _, shape in value["regions"]]
        for chunk in entry.chunks:
            units[(key, tuple(chunk.offsets), tuple(chunk.sizes))] = (int(np.prod(tuple(chunk.sizes)))
                                                                      * entry.properties.dtype.itemsize)
    files = plan_files(hub, max_shard_size)
    load, owner = [0] * world_size, {}
    for unit in sorted(units, key=lambda u: (-units[u], u[0], u[1] or (), u[2] or ())):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[unit] = rank
        load[rank] += units[unit]
    return files, owner


def _read_and_write(folder: str, mine: list, tensors: dict, metadata: dict, files, out: Files, buffer_bytes: int,
                    model=None):
    """Read this process's units with DCP's reader and write them into the output: each stored chunk as it arrives;
    a converted tensor (``model``: the meta model converting it) whole, one at a time, then converted and dropped."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

    from .hub_keys import convert_whole

    written, whole = [0], {}

    class StreamToFiles(LoadPlanner):  # a chunk: a buffer for DCP to fill, written and dropped; or a view of `whole`
        def set_up_planner(self, *args, **kwargs):
            pass

        def create_local_plan(self):
            raise NotImplementedError

        def create_global_plan(self, plans):
            return plans

        def finish_plan(self, plan):
            return plan

        def load_bytes(self, read_item, value):
            raise AssertionError("a Hub export reads tensors only")

        def resolve_tensor(self, read_item):
            key = read_item.dest_index.fqn
            if key in whole:
                return whole[key][tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets, read_item.lengths))]
            return torch.empty(tuple(read_item.lengths), dtype=metadata[key].properties.dtype)

        def commit_tensor(self, read_item, tensor):
            key = read_item.dest_index.fqn
            if key in whole:
                return
            entry = metadata[key]
            written[0] += write_box(out, files.where, tuple(entry.size), entry.properties.dtype.itemsize,
                                    tensors[key]["regions"], tuple(read_item.dest_offsets), tuple(read_item.lengths),
                                    tensor, buffer_bytes)

    reader = FileSystemReader(folder)
    reader.set_up_storage_reader(reader.read_metadata(), True)

    def read(units) -> None:
        items = [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(key, offsets), dest_offsets=offsets,
                          storage_index=MetadataIndex(key, offsets), storage_offsets=(0,) * len(offsets),
                          lengths=sizes) for key, offsets, sizes in units]
        reader.read_data(reader.prepare_local_plan(LoadPlan(items)), StreamToFiles()).wait()

    read([unit for unit in mine if unit[1] is not None])
    for key, _, _ in (unit for unit in mine if unit[1] is None):
        entry = metadata[key]
        whole[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        read([(key, tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks])
        full = whole.pop(key).reshape(model_shape(model, key, entry))
        outputs = convert_whole(model, key.removeprefix("model/"), full)
        written[0] += write_converted(out, files.where, outputs)
    return written[0]


def _config_writer(folder: str):
    """Rank 0: the configs kept in ``hub/``, ``dtype`` set to the saved weights' when they have one."""
    from ..training.checkpoint_hub import HUB_DIR

    def write(target: str, floating_dtypes) -> None:
        source = os.path.join(folder, HUB_DIR)
        with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
        if len(floating_dtypes) == 1:
            config["dtype"] = str(next(iter(floating_dtypes))).removeprefix("torch.")
        with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
            handle.write("\n")
        if os.path.isfile(os.path.join(source, "generation_config.json")):
            shutil.copy2(os.path.join(source, "generation_config.json"), target)

    return write


def consolidate(checkpoint, output, *, max_shard_size="5GB", buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> dict:
    """Write the Hub folder ``output`` from the training checkpoint ``checkpoint`` (see the module docstring). Call on
    every process of the group (one process: no group needed). Returns this process's ``{"bytes", "chunks"}``."""
    import torch.distributed as dist

    from .hub_export import check_options

    output = check_options(output, max_shard_size, buffer_bytes)
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    context = SimpleNamespace(rank=rank, world_size=world)
    error = None
    try:
        folder = _step_folder(os.fspath(checkpoint))
        tensors, metadata = read_export(folder)
        files, owner = _plan(tensors, metadata, max_shard_size, world)
        converting = any(unit[1] is None and r == rank for unit, r in owner.items())
        model = meta_model(folder) if converting else None
    except Exception as caught:  # noqa: BLE001 - the same on every process, raised by all
        error = caught
    agree_on_failure(context, error, what=f"checkpoint consolidate {checkpoint}")
    staging = None
    if rank == 0:
        try:
            staging = prepare_staging(output, files)
        except Exception as caught:  # noqa: BLE001
            error = caught
    staging = agree_on_failure(context, error, what="checkpoint consolidate (creating the files)", value=staging)[0]
    mine = [chunk for chunk, r in owner.items() if r == rank]
    out, written = Files(staging), 0
    try:
        written = _read_and_write(folder, mine, tensors, metadata, files, out, buffer_bytes, model)
        out.close(sync=True)
    except Exception as caught:  # noqa: BLE001
        out.close(sync=False)
        error = caught
    try:
        agree_on_failure(context, error, what="checkpoint consolidate (writing the tensors)")
        if rank == 0:
            try:
                finish(staging, output, files, _config_writer(folder))
            except Exception as caught:  # noqa: BLE001
                error = caught
        agree_on_failure(context, error, what="checkpoint consolidate (publishing the folder)")
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"bytes": written, "chunks": len(mine), "total_bytes": sum(t.nbytes for t in files.tensors.values()),
            "dtypes": sorted({str(DTYPES_BY_NAME[t.dtype]) for t in files.tensors.values()})}
