"""Hub safetensors files planned before any tensor exists, so that many processes can fill them in place.

``plan_files`` lays out the shards of a Hub folder from the tensors' names, shapes and dtypes alone: which file
holds each tensor (``huggingface_hub``'s rule: tensors in order, a new file when the next one would pass
``max_shard_size``, a tensor larger than that alone in its file; names ``model.safetensors`` or
``model-0000k-of-0000n.safetensors``), each file's header and each tensor's byte offset in it. The header is the
one ``safetensors.torch.save_file`` writes for the same tensors (``{"__metadata__": {"format": "pt"}, ...}``,
tensors by descending dtype then name, padded with spaces to 8 bytes), so a folder written here is byte for byte
what the single-process writer makes.

``create_files`` (one process) writes every header and sizes every file (sparse); then any process writes any
tensor's bytes with :func:`pwrite_all` (``os.pwrite`` at the planned offsets). ``index_json`` is
``model.safetensors.index.json``. No collective here.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np
import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names, in the order of its Dtype enum (files sort tensors by it, descending)
_DTYPES = [(torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"), (torch.float8_e5m2, "F8_E5M2"),
           (torch.float8_e4m3fn, "F8_E4M3"), (torch.int16, "I16"), (torch.uint16, "U16"), (torch.float16, "F16"),
           (torch.bfloat16, "BF16"), (torch.int32, "I32"), (torch.uint32, "U32"), (torch.float32, "F32"),
           (torch.float64, "F64"), (torch.int64, "I64"), (torch.uint64, "U64")]
DTYPE_NAMES = {dtype: name for dtype, name in _DTYPES}
DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPES}
_ORDER = {name: i for i, (_, name) in enumerate(_DTYPES)}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"safetensors cannot store dtype {dtype}")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class HubTensor:
    """One tensor of the Hub folder: name, shape and safetensors dtype name."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return DTYPES_BY_NAME[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclass
class FilePlan:
    """Where every tensor goes: ``files[name] = header bytes``, ``where[key] = (file name, absolute byte offset)``,
    ``sizes[name]`` the file's length."""

    files: dict[str, bytes] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    where: dict[str, tuple[str, int]] = field(default_factory=dict)
    tensors: dict[str, HubTensor] = field(default_factory=dict)

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes (``"5GB"``, ``"500MB"``, or an int)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a size such as '5GB' or a number of bytes, got {size!r}")
    value = parse_size_to_int(size) if isinstance(size, str) else int(size)
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _header(tensors: list[HubTensor]) -> tuple[bytes, dict[str, int]]:
    """The file header (length prefix included) and each tensor's offset within the data section."""
    ordered = sorted(tensors, key=lambda t: (-_ORDER[t.dtype], t.key))
    entries, offsets, position = {"__metadata__": {"format": "pt"}}, {}, 0
    for tensor in ordered:
        entries[tensor.key] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                               "data_offsets": [position, position + tensor.nbytes]}
        offsets[tensor.key] = position
        position += tensor.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def plan_files(tensors: list[HubTensor], max_shard_size: int | str) -> FilePlan:
    """The shard files for ``tensors`` (in this order), as ``huggingface_hub.split_torch_state_dict_into_shards``
    groups them, with headers and offsets."""
    limit = parse_size(max_shard_size)
    groups: list[list[HubTensor]] = []
    current, current_size = [], 0
    for tensor in tensors:
        if tensor.nbytes > limit:  # alone in its own file
            groups.append([tensor])
            continue
        if current and current_size + tensor.nbytes > limit:
            groups.append(current)
            current, current_size = [], 0
        current.append(tensor)
        current_size += tensor.nbytes
    if current or not groups:
        groups.append(current)
    plan = FilePlan(tensors={t.key: t for t in tensors})
    for i, group in enumerate(groups):
        name = SINGLE_FILE if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offsets = _header(group)
        plan.files[name] = header
        plan.sizes[name] = len(header) + sum(t.nbytes for t in group)
        for tensor in group:
            plan.where[tensor.key] = (name, len(header) + offsets[tensor.key])
    return plan


def create_files(folder: str, plan: FilePlan, names: list[str] | None = None) -> None:
    """Write the header of each planned file (``names``: a subset) and give it its full, still sparse, length."""
    for name in plan.files if names is None else names:
        with open(os.path.join(folder, name), "wb") as handle:
            handle.write(plan.files[name])
            handle.truncate(plan.sizes[name])


def index_json(plan: FilePlan) -> str:
    """``model.safetensors.index.json`` of a sharded plan (what ``transformers`` writes)."""
    total = sum(t.nbytes for t in plan.tensors.values())
    parameters = sum(int(np.prod(t.shape, dtype=np.int64)) for t in plan.tensors.values())
    weight_map = {key: plan.where[key][0] for key in sorted(plan.tensors)}
    return json.dumps({"metadata": {"total_parameters": parameters, "total_size": total}, "weight_map": weight_map},
                      indent=2, sort_keys=True) + "\n"


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a ``uint8`` array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def pwrite_all(fd: int, data: np.ndarray, file_offsets: np.ndarray, data_offsets: np.ndarray,
               sizes: np.ndarray) -> int:
    """``os.pwrite`` ``data[data_offsets[i]:+sizes[i]]`` at ``file_offsets[i]`` for every ``i``; writes that follow
    each other in both the data and the file are merged into one call. Returns the bytes written."""
    count, i, total = len(sizes), 0, 0
    while i < count:
        j = i + 1
        while (j < count and file_offsets[j] == file_offsets[j - 1] + sizes[j - 1]
               and data_offsets[j] == data_offsets[j - 1] + sizes[j - 1]):
            j += 1
        start, offset = int(data_offsets[i]), int(file_offsets[i])
        view = memoryview(data[start: int(data_offsets[j - 1] + sizes[j - 1])])
        while len(view):  # pwrite may write less than asked
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
            total += written
        i = j
    return total
