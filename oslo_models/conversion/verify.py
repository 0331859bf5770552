"""``python -m oslo_models checkpoint verify FOLDER``: is this Hub folder or training checkpoint whole and consistent?

A **training checkpoint** (a ``save_checkpoint`` folder or one ``step-N`` folder): every file's size and SHA-256
against the ``checksums.json`` recorded at save time (``training/checkpoint_integrity.py``), and DCP's metadata
readable.

A **Hub folder**: ``config.json`` parses; every safetensors file's header parses, its tensors' byte ranges tile the
data section exactly (no gap, no overlap, the file's length), each range holds ``shape x dtype`` bytes; the index
(sharded folders) names only files that exist, each key in the file the index names and nowhere else, and its
``total_size`` is the data's. The report lists each file's size and SHA-256 (what the Hub stores for LFS files);
``expect=`` a report saved earlier (``--json``) compares the hashes, to check a copy or an upload.

Read only; one process.
"""
from __future__ import annotations

import json
import os
import struct
from types import SimpleNamespace

import numpy as np

from .safetensors_files import DTYPES_BY_NAME, INDEX_FILE, SINGLE_FILE


def _header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > os.path.getsize(path) - 8:
            raise ValueError(f"header length {length} runs past the end of the file")
        return json.loads(handle.read(length)), 8 + length


def _check_file(path: str) -> tuple[dict[str, tuple], list[str]]:
    """``({key: (shape, dtype)}, problems)`` of one safetensors file."""
    name, problems, found = os.path.basename(path), [], {}
    try:
        header, data_start = _header(path)
    except (ValueError, OSError) as error:
        return {}, [f"{name}: unreadable header ({error})"]
    header.pop("__metadata__", None)
    ranges = []
    for key, info in header.items():
        dtype, shape, (begin, end) = info.get("dtype"), info.get("shape"), info.get("data_offsets", (0, -1))
        if dtype not in DTYPES_BY_NAME:
            problems.append(f"{name}: {key} has unknown dtype {dtype!r}")
            continue
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES_BY_NAME[dtype].itemsize
        if end - begin != nbytes:
            problems.append(f"{name}: {key} holds {end - begin} bytes, {shape} x {dtype} needs {nbytes}")
        ranges.append((begin, end, key))
        found[key] = (tuple(shape), dtype)
    position = 0
    for begin, end, key in sorted(ranges):
        if begin != position:
            problems.append(f"{name}: {key} starts at byte {begin} of the data, expected {position} (gap/overlap)")
        position = max(position, end)
    size = os.path.getsize(path) - data_start
    if position != size:
        problems.append(f"{name}: the tensors end at byte {position} of the data, the file holds {size}")
    return found, problems


def verify_hub_folder(folder: str, expect: dict | None = None) -> dict:
    """The report of a Hub folder: ``{"kind", "ok", "problems", "files": {name: [size, sha256]}, "tensors"}``."""
    from ..training.checkpoint_integrity import digest

    problems, keys = [], {}
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            json.load(handle)
    except (OSError, ValueError) as error:
        problems.append(f"config.json: {error}")
    index_path = os.path.join(folder, INDEX_FILE)
    index = None
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as handle:
            index = json.load(handle)
        names = sorted(set(index["weight_map"].values()))
    else:
        names = [SINGLE_FILE]
    total = 0
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{name}: missing")
            continue
        found, file_problems = _check_file(path)
        problems += file_problems
        for key, (shape, dtype) in found.items():
            if key in keys:
                problems.append(f"{key} is in {keys[key][0]} and in {name}")
            keys[key] = (name, shape, dtype)
            total += int(np.prod(shape, dtype=np.int64)) * DTYPES_BY_NAME[dtype].itemsize
    if index is not None:
        for key, name in index["weight_map"].items():
            if key not in keys:
                problems.append(f"the index puts {key} in {name}, which does not hold it")
            elif keys[key][0] != name:
                problems.append(f"the index puts {key} in {name}, it is in {keys[key][0]}")
        problems += [f"{key} (in {keys[key][0]}) is not in the index" for key in keys if key not in index["weight_map"]]
        stated = index.get("metadata", {}).get("total_size")
        if stated is not None and stated != total:
            problems.append(f"the index's total_size is {stated}, the tensors hold {total} bytes")
    files = {name: list(digest(os.path.join(folder, name))) for name in sorted(os.listdir(folder))
             if os.path.isfile(os.path.join(folder, name))}
    if expect is not None:
        for name, (size, sha) in expect.get("files", {}).items():
            if name not in files:
                problems.append(f"{name}: missing (expected {size} bytes)")
            elif files[name] != [size, sha]:
                problems.append(f"{name}: SHA-256/size differ from the expected report")
    return {"kind": "hub", "folder": folder, "ok": not problems, "problems": problems, "files": files,
            "tensors": len(keys)}


def verify_training_checkpoint(folder: str) -> dict:
    """The report of a training checkpoint's newest complete step (or the given step folder)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ..training.checkpoint_folders import describe_missing, find_checkpoint
    from ..training.checkpoint_integrity import CHECKSUMS, CorruptCheckpointError, verify_checksums

    step = find_checkpoint(folder)
    if step is None:
        return {"kind": "training", "folder": folder, "ok": False, "problems": [describe_missing(folder)]}
    problems, checked = [], False
    try:
        checked = verify_checksums(SimpleNamespace(rank=0, world_size=1), step)
        FileSystemReader(step).read_metadata()
    except CorruptCheckpointError as error:
        problems.append(str(error))
    except Exception as error:  # noqa: BLE001 - an unreadable metadata file is a finding
        problems.append(f"DCP metadata unreadable: {type(error).__name__}: {error}")
    if not checked and not problems:
        problems.append(f"{step} has no {CHECKSUMS} (saved before checksums existed): nothing to verify against")
    return {"kind": "training", "folder": step, "ok": not problems, "problems": problems}


def verify(folder, expect: dict | None = None) -> dict:
    """A Hub folder's or a training checkpoint's report (see the module docstring)."""
    folder = os.path.abspath(os.fspath(folder))
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} is not a folder")
    if os.path.isfile(os.path.join(folder, SINGLE_FILE)) or os.path.isfile(os.path.join(folder, INDEX_FILE)):
        return verify_hub_folder(folder, expect)
    return verify_training_checkpoint(folder)
