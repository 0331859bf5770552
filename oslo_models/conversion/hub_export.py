"""A plain Hub folder written by every rank at once, each writing what it holds: nothing gathered on one rank.

``export_hub_folder(context, build_entries, save_directory, ...)`` (collective, every rank calls it):

1. Each rank lists its entries (``export_pieces``: for every model tensor, the Hub tensors it becomes and the boxes
   of it this rank holds, as views of its own memory) and all ranks exchange the lists, without data (one
   ``all_gather_object`` of shapes and box corners).
2. Every rank computes the same plan: the Hub tensors in model order, the shard files (``safetensors_files``:
   ``max_shard_size``, headers, byte offsets, byte for byte what ``safetensors`` writes), and for each distinct box
   one writer among the ranks that hold it (data-parallel replicas, HSDP replica groups, tensor-parallel ranks of a
   replicated tensor, replicated key/value heads), the largest boxes first, each to the holder with the fewest bytes
   so far, so every rank writes about ``1/N`` of the model. The boxes of each tensor must add up to exactly the
   tensor (an internal check: a layout whose boxes do not is an error, never a silently wrong file).
3. Global rank 0 creates a staging sibling of ``save_directory`` with every file's header at its full (sparse)
   length; then every rank ``pwrite``s its boxes at their offsets, through a host copy of at most ``buffer_bytes``
   at a time (a device tensor, a non-contiguous view), fsyncs and closes. A generic tensor that ``transformers``
   converts on save (not a rename or a slice) is all-gathered over its own mesh, one tensor at a time, and one rank
   converts and writes it.
4. Rank 0 writes ``model.safetensors.index.json`` (sharded folders), ``config.json`` / ``generation_config.json``,
   carries the user's other files over (a tokenizer) and swaps the folder in atomically (``atomic.publish_dir``):
   a save killed at any point leaves the previous folder as it was.

Memory per rank: its own parameters (already there) plus one copy of at most ``buffer_bytes`` (default
``DEFAULT_BUFFER_BYTES``), plus the plan (a few numbers per tensor). Failures on any rank are raised on every rank
(``agree_on_failure``) and the staging folder is removed. Every rank must see the same file system at
``save_directory`` (as for ``save_checkpoint``); ranks write disjoint byte ranges of the same files.
"""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import torch

from ..distributed.agreement import agree_on_failure
from .atomic import make_staging_dir, publish_dir, recover_folder, remove_stale_staging
from .boxes import flat_runs, grid_of, split_box
from .safetensors_files import (
    DTYPES_BY_NAME,
    INDEX_FILE,
    FilePlan,
    HubTensor,
    as_bytes,
    create_files,
    index_json,
    parse_size,
    plan_files,
    pwrite_all,
)

DEFAULT_BUFFER_BYTES = 256 * 2**20


def check_options(save_directory, max_shard_size, buffer_bytes) -> str:
    """The absolute folder; ``ValueError`` for a bad option (before any collective)."""
    save_directory = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(save_directory):
        raise ValueError(f"save_directory {save_directory!r} is a file, not a folder")
    check_sizes(max_shard_size, buffer_bytes)
    return save_directory


def check_sizes(max_shard_size, buffer_bytes) -> None:
    """``ValueError`` for a bad ``max_shard_size`` or ``buffer_bytes`` (before any collective)."""
    parse_size(max_shard_size)
    if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be a positive number of bytes, got {buffer_bytes!r}")


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


class ExportPlan:
    """The plan every rank computes from all ranks' descriptions (see the module docstring, step 2)."""

    def __init__(self, described: list[list[dict]], max_shard_size):
        self.tensors: dict[str, dict] = {}  # model tensor name -> its description (first holder's)
        every: dict[str, list] = {}
        for rank, entries in enumerate(described):
            for entry in entries:
                known = self.tensors.setdefault(entry["name"], entry)
                if (known["shape"], known["dtype"]) != (entry["shape"], entry["dtype"]):
                    raise RuntimeError(f"{entry['name']}: rank {rank} holds a {entry['dtype']} {entry['shape']} "
                                       f"tensor, another rank a {known['dtype']} {known['shape']} one")
                every.setdefault(entry["name"], []).extend((tuple(s), tuple(n), rank) for s, n in entry["boxes"])
        self.grid = {name: grid_of([(s, n) for s, n, _ in boxes]) for name, boxes in every.items()}
        holders: dict[tuple, list[int]] = {}  # (name, start, length) of a cut box -> the ranks holding it
        for name, boxes in every.items():
            for start, length, rank in boxes:
                for sub_start, sub_length, _ in split_box(start, length, self.grid[name]):
                    ranks = holders.setdefault((name, sub_start, sub_length), [])
                    if rank not in ranks:
                        ranks.append(rank)
        hub = []
        for name, entry in self.tensors.items():
            if entry["converted"] is not None:
                hub += [HubTensor(key, tuple(shape), dtype) for key, shape, dtype in entry["converted"]]
            else:
                hub += [HubTensor(key, tuple(shape), entry["dtype"]) for key, _, shape in entry["regions"]]
        keys = [t.key for t in hub]
        if len(set(keys)) != len(keys):
            twice = sorted({k for k in keys if keys.count(k) > 1})
            raise RuntimeError(f"several model tensors are saved under the same Hub key(s) {twice[:5]}")
        self.files = plan_files(hub, max_shard_size)
        self._check_coverage(holders)
        self.writer: dict[tuple, int] = {}
        self.load = [0] * len(described)
        for box in sorted(holders, key=lambda b: (-_numel(b[2]) * self._itemsize(b[0]), b)):
            rank = min(holders[box], key=lambda r: (self.load[r], r))
            self.writer[box] = rank
            self.load[rank] += _numel(box[2]) * self._itemsize(box[0])

    def _itemsize(self, name: str) -> int:
        return DTYPES_BY_NAME[self.tensors[name]["dtype"]].itemsize

    def _check_coverage(self, holders) -> None:
        covered: dict[str, int] = {}
        for name, _, length in holders:
            covered[name] = covered.get(name, 0) + _numel(length)
        for name, entry in self.tensors.items():
            if covered.get(name, 0) != _numel(entry["shape"]):
                raise RuntimeError(f"{name}: the ranks' pieces cover {covered.get(name, 0)} of its "
                                   f"{_numel(entry['shape'])} elements (a layout's boxes are wrong)")


class Files:
    """This rank's open shard files (write-only), fsynced and closed together."""

    def __init__(self, folder: str):
        self.folder, self.fds = folder, {}

    def fd(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = os.open(os.path.join(self.folder, name), os.O_WRONLY)
        return self.fds[name]

    def close(self, sync: bool) -> None:
        try:
            if sync:
                for fd in self.fds.values():
                    os.fsync(fd)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds = {}


def write_box(files: Files, where: dict, shape, itemsize: int, regions, start, length, view,
              buffer_bytes: int) -> int:
    """Write one box (``start``, ``length``; data ``view``) of a tensor of ``shape`` into the Hub tensors it falls
    in (``regions``: ``(key, first flat element, shape)``, placed at ``where[key] = (file, byte offset)``), through
    host copies of at most ``buffer_bytes`` (and run lists of at most ``buffer_bytes`` too: ~64 bytes a run).
    Returns the bytes written."""
    if not length or _numel(length) == 0:
        rows_per_chunk, num_rows = 1, 1 if not length else 0
    else:
        num_rows = length[0]
        runs_per_row = len(flat_runs(shape, start, (1, *length[1:]))[0])
        rows_per_chunk = max(1, min(buffer_bytes // max(1, _numel(length[1:]) * itemsize),
                                    buffer_bytes // (64 * max(1, runs_per_row))))
    written = 0
    for r0 in range(0, num_rows, rows_per_chunk):
        n = min(rows_per_chunk, num_rows - r0)
        chunk = view if not length else view.narrow(0, r0, n)
        data = as_bytes(chunk.detach().to("cpu").contiguous())  # the bounded host copy (none when already so)
        sub_start = tuple(start) if not length else (start[0] + r0, *start[1:])
        sub_length = tuple(length) if not length else (n, *length[1:])
        starts, run = flat_runs(shape, sub_start, sub_length)
        ends = starts + run
        run_data = np.arange(len(starts), dtype=np.int64) * run  # element offset of each run in `data`
        for key, region_start, region_shape in regions:
            region_end = region_start + _numel(region_shape)
            lo, hi = np.maximum(starts, region_start), np.minimum(ends, region_end)
            hit = hi > lo
            if not hit.any():
                continue
            file_name, base = where[key]
            written += pwrite_all(files.fd(file_name), data, base + (lo[hit] - region_start) * itemsize,
                                  (run_data[hit] + lo[hit] - starts[hit]) * itemsize, (hi[hit] - lo[hit]) * itemsize)
    return written


def write_converted(files: Files, where: dict, outputs: dict[str, torch.Tensor]) -> int:
    """Write a converted tensor's Hub tensors (whole, contiguous) at their planned places; the bytes written."""
    written = 0
    for key, value in outputs.items():
        file_name, base = where[key]
        data = as_bytes(value.detach().to("cpu").contiguous())
        written += pwrite_all(files.fd(file_name), data, np.array([base]), np.array([0]), np.array([data.size]))
    return written


def prepare_staging(save_directory: str, files: FilePlan) -> str:
    """Rank 0: a staging sibling holding every planned file (headers, full sparse length)."""
    recover_folder(save_directory)  # a crash between the fallback renames of an earlier save left it aside
    remove_stale_staging(save_directory)
    staging = make_staging_dir(save_directory)
    try:
        create_files(staging, files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def floating_dtypes(files: FilePlan) -> set[torch.dtype]:
    """The floating dtypes of the planned tensors (``config.dtype`` is set when there is one)."""
    dtypes = {DTYPES_BY_NAME[t.dtype] for t in files.tensors.values()}
    return {dtype for dtype in dtypes if dtype.is_floating_point}


def finish(staging: str, save_directory: str, files: FilePlan, write_configs) -> None:
    """Rank 0: index, configs (``write_configs(folder, floating dtypes)``), the user's other files, then the atomic
    swap."""
    from ..utils.files import atomic_write_file
    from .saving import _carry_over_files

    if files.is_sharded:
        text = index_json(files)
        atomic_write_file(os.path.join(staging, INDEX_FILE), lambda handle: handle.write(text.encode("utf-8")))
    write_configs(staging, floating_dtypes(files))
    if os.path.isdir(save_directory):
        _carry_over_files(save_directory, staging)
    publish_dir(staging, save_directory)  # fsyncs, then one atomic swap


def _write_mine(entries, plan: ExportPlan, rank: int, files: Files, buffer_bytes: int, convert):
    """Write the (cut) boxes the plan gives this rank; ``(bytes written, first error or None)``. A converted tensor's
    gather runs on every holder even after an error, so that no rank is left waiting in it."""
    written, error = 0, None
    try:
        for entry in entries:
            for piece_start, piece_length, view in entry.pieces:
                for start, length, offset in split_box(piece_start, piece_length, plan.grid[entry.name]):
                    mine = plan.writer[(entry.name, start, length)] == rank
                    if entry.converted is not None:  # every holder joins the gather; the writer converts, writes
                        whole = entry.whole()
                        if mine and error is None:
                            try:
                                written += write_converted(files, plan.files.where, convert(entry.name, whole))
                            except Exception as caught:  # noqa: BLE001
                                error = caught
                        del whole
                    elif mine and error is None:
                        box = view[tuple(slice(o, o + n) for o, n in zip(offset, length))]
                        try:
                            written += write_box(files, plan.files.where, entry.shape,
                                                 DTYPES_BY_NAME[entry.dtype].itemsize, entry.regions, start, length,
                                                 box, buffer_bytes)
                        except Exception as caught:  # noqa: BLE001
                            error = caught
        files.close(sync=error is None)
    except Exception as caught:  # noqa: BLE001 - a converted tensor's gather failed here
        error = error or caught
        files.close(sync=False)
    return written, error


def export_hub_folder(context, build_entries, save_directory, *, write_configs, max_shard_size="5GB",
                      buffer_bytes: int = DEFAULT_BUFFER_BYTES, convert=None) -> dict:
    """Write the Hub folder (see the module docstring). ``build_entries()``: this rank's ``export_pieces.Entry``
    list (no collective); ``write_configs(folder, floating dtypes)``: rank 0 writes the configs;
    ``convert(name, tensor)``: the Hub tensors of a converted generic tensor. Returns this rank's ``{"bytes",
    "seconds", "planned_bytes"}``."""
    save_directory = check_options(save_directory, max_shard_size, buffer_bytes)
    began = time.perf_counter()
    entries, error = [], None
    try:
        entries = build_entries()
        mine = [entry.describe() for entry in entries]
    except Exception as caught:  # noqa: BLE001 - raised on every rank by agree_on_failure
        error, mine = caught, None
    described = agree_on_failure(context, error, what="save_pretrained (listing the tensors)", value=mine)
    plan = ExportPlan(described, max_shard_size)  # the same on every rank, from the same input

    staging, error = None, None
    if context.rank == 0:
        try:
            staging = prepare_staging(save_directory, plan.files)
        except Exception as caught:  # noqa: BLE001
            error = caught
    staging = agree_on_failure(context, error, what="save_pretrained (creating the files)", value=staging)[0]

    files = Files(staging)
    written, error = _write_mine(entries, plan, context.rank, files, buffer_bytes, convert)
    try:
        agree_on_failure(context, error, what="save_pretrained (writing the tensors)")
        error = None
        if context.rank == 0:
            try:
                finish(staging, save_directory, plan.files, write_configs)
            except Exception as caught:  # noqa: BLE001
                error = caught
        agree_on_failure(context, error, what="save_pretrained (publishing the folder)")
    except BaseException:
        if context.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"bytes": written, "planned_bytes": plan.load[context.rank], "seconds": time.perf_counter() - began}
