"""Lazy, sliceable access to a Hub-format checkpoint (local folder, Hub cache or Hub download).

``CheckpointReader.open(name_or_path, ...)`` resolves the weight files with ``huggingface_hub`` and reads each
tensor's shape from the file headers only. ``read(key, index)`` returns just ``tensor[index]``:

- safetensors (single file or sharded with ``model.safetensors.index.json``): ``safe_open(...).get_slice``
  reads only the requested rows/columns from disk;
- legacy ``pytorch_model.bin`` (single or sharded): ``torch.load(weights_only=True, mmap=True)``, so no pickled
  code runs and pages are touched only when sliced.

Every problem that the index and the file headers show is found on every rank before any collective runs (each
rank opens every header itself, whatever it will read): a missing shard is a ``FileNotFoundError``; a truncated or
corrupt file, a pickle ``weights_only`` refuses, or an index entry whose tensor no shard holds, a ``ValueError``
naming the file or the entry. The headers are the truth: an index that names the wrong shard for a tensor that
another shard holds is followed to where the tensor is (as ``transformers`` does), with a warning.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Iterable

import torch

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_CANDIDATES = (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)


def resolve_file(name_or_path: str, filename: str, *, revision=None, token=None, cache_dir=None,
                 local_files_only: bool = False, subfolder: str = "") -> str | None:
    """Path of ``filename`` in a local folder or the Hub repo (downloaded to the cache); ``None`` if absent."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, subfolder, filename)
        return path if os.path.isfile(path) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return hf_hub_download(name_or_path, filename, subfolder=subfolder or None, revision=revision, token=token,
                               cache_dir=cache_dir, local_files_only=local_files_only)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return None


class CheckpointReader:
    """Tensor name -> file; shapes from headers; slices on demand."""

    def __init__(self, key_to_file: dict[str, str], *, index_path: str | None = None):
        self._handles: dict[str, object] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.key_to_file: dict[str, str] = {}  # from the headers: where each tensor really is
        for path in sorted(set(key_to_file.values())):
            self._open(path)
        if index_path is not None:
            _check_index(key_to_file, self.key_to_file, index_path)

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, name_or_path: str | os.PathLike, **hub_kwargs) -> "CheckpointReader":
        name_or_path = str(name_or_path)
        for candidate in _CANDIDATES:
            path = resolve_file(name_or_path, candidate, **hub_kwargs)
            if path is None:
                continue
            if candidate.endswith(".index.json"):
                return cls(_files_from_index(name_or_path, path, hub_kwargs), index_path=path)
            return cls({key: path for key in _keys_of_file(path)})
        raise FileNotFoundError(f"No model weights found in {name_or_path!r}: looked for {', '.join(_CANDIDATES)}")

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, torch.Tensor]) -> "InMemoryReader":
        return InMemoryReader(state_dict)

    def _open(self, path: str) -> None:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            try:
                with safe_open(path, framework="pt") as handle:
                    for key in handle.keys():
                        self._shapes[key] = tuple(handle.get_slice(key).get_shape())
                        self.key_to_file[key] = path
            except Exception as error:  # safetensors raises its own error type for a truncated/corrupt header
                raise ValueError(f"Checkpoint shard {path} is truncated or corrupt: {error}") from error
            _check_safetensors_size(path)
            handle = None  # reopened per read: see ``read``
        else:
            handle = _load_bin(path)
            for key, tensor in handle.items():
                if torch.is_tensor(tensor):
                    self._shapes[key] = tuple(tensor.shape)
                    self.key_to_file[key] = path
        self._handles[path] = handle

    # ------------------------------------------------------------------ access
    def keys(self) -> Iterable[str]:
        return self._shapes.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._shapes

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        """``tensor[index]`` as a new CPU tensor (index: a tuple of slices; ``None`` reads everything)."""
        path = self.key_to_file[key]
        handle = self._handles[path]
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            # A short-lived mapping per read: the pages a strided (column) slice touches leave this process's
            # RSS when it closes, so peak memory stays "local shard + one tensor", not "whole file".
            with safe_open(path, framework="pt") as handle:
                return handle.get_slice(key)[index] if index is not None else handle.get_tensor(key)
        tensor = handle[key]
        return (tensor[index] if index is not None else tensor).clone()


class InMemoryReader(CheckpointReader):
    """The reader interface over an in-memory state dict (used to shard freshly initialized full weights)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict = state_dict
        self._shapes = {key: tuple(value.shape) for key, value in state_dict.items()}

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        tensor = self.state_dict[key]
        return (tensor[index] if index is not None else tensor).clone()


# ---------------------------------------------------------------------------------------------- helpers
def _files_from_index(name_or_path: str, index_path: str, hub_kwargs: dict) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
    except (json.JSONDecodeError, KeyError) as error:
        raise ValueError(f"Checkpoint index {index_path} is corrupt: {error}") from error
    resolved, missing = {}, []
    for filename in sorted(set(weight_map.values())):
        path = resolve_file(name_or_path, filename, **hub_kwargs)
        if path is None:
            missing.append(filename)
        resolved[filename] = path
    if missing:
        raise FileNotFoundError(f"Checkpoint {name_or_path!r}: the index {os.path.basename(index_path)} lists "
                                f"shard(s) that are missing: {missing}")
    return {key: resolved[filename] for key, filename in weight_map.items()}


def _check_index(index_map: dict[str, str], found: dict[str, str], index_path: str) -> None:
    """The index against the headers: an entry no shard holds is an error; a wrong shard name only a warning."""
    name = os.path.basename(index_path)
    absent = sorted(key for key in index_map if key not in found)
    if absent:
        shown = ", ".join(f"{key!r} -> {os.path.basename(index_map[key])}" for key in absent[:5])
        more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
        raise ValueError(f"Checkpoint index {index_path} lists tensor(s) that no shard holds: {shown}{more}; the "
                         f"shard files do not match {name} (an interrupted upload or copy?)")
    moved = sorted(key for key in index_map if found[key] != index_map[key])
    if moved:
        key = moved[0]
        logger.warning("Checkpoint index %s maps %d tensor(s) to the wrong shard (e.g. %r -> %s, but it is in %s); "
                       "reading them from the shard that holds them", name, len(moved), key,
                       os.path.basename(index_map[key]), os.path.basename(found[key]))


def _keys_of_file(path: str) -> list[str]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as handle:
                return list(handle.keys())
        except Exception as error:
            raise ValueError(f"Checkpoint shard {path} is truncated or corrupt: {error}") from error
    return [key for key, value in _load_bin(path).items() if torch.is_tensor(value)]


def _check_safetensors_size(path: str) -> None:
    """safetensors maps lazily, so a file cut short after its header is caught here, not mid-load."""
    import struct

    with open(path, "rb") as handle:
        header_len = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(header_len))
    data_end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    expected = 8 + header_len + data_end
    actual = os.path.getsize(path)
    if actual < expected:
        raise ValueError(f"Checkpoint shard {path} is truncated: {actual} bytes, the header describes {expected}")


def _load_bin(path: str) -> dict:
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format: no mmap
    except Exception as error:  # UnpicklingError (refused by weights_only), truncated zip, ...
        raise ValueError(f"Checkpoint shard {path} could not be read safely with torch.load(weights_only=True) "
                         f"(no pickled code is run): {type(error).__name__}: {error}") from error
    if not isinstance(loaded, dict):
        raise ValueError(f"Checkpoint shard {path} holds a {type(loaded).__name__}, not a state dict")
    return loaded
