"""Checkpoint keys that ``transformers`` renames on load and back on save (its ``conversion_mapping`` renamings).

GPT-NeoX is the case: ``transformers`` 5 holds the LM head as ``lm_head`` (its module tree), but Hub checkpoints
(Pythia, GPT-NeoX-20B) store ``embed_out.weight``, and ``transformers``' ``save_pretrained`` writes that name again,
so older ``transformers`` versions load what it saves. This is the same two-way renaming for the sliced loader and
the saver, with nothing read early:

- ``RenamedKeyReader``: a ``CheckpointReader`` view that shows stored keys under other names (here the module
  names; a checkpoint already in them passes through);
- ``RenamedHubKeys``: the model mixin that applies it when loading and renames the gathered state back when saving
  (``hub_key_renames``: ``(stored prefix, module prefix)`` pairs, matched at the start of a key).
"""
from __future__ import annotations

import functools
from typing import Callable, ClassVar

import torch


def _rename(key: str, renames, *, to_module: bool) -> str:
    for stored, module in renames:
        old, new = (stored, module) if to_module else (module, stored)
        if key.startswith(old):
            return new + key[len(old):]
    return key


class RenamedKeyReader:
    """A ``CheckpointReader`` seen under other key names: ``rename(stored key)`` is the key the model asks for, and a
    read goes to the stored key (no tensor is read early). ``legacy_keys.py`` and :class:`RenamedHubKeys` use it."""

    def __init__(self, reader, rename: Callable[[str], str]):
        self.reader = reader
        self._to_stored = {rename(key): key for key in reader.keys()}

    @classmethod
    def wrap(cls, reader, rename: Callable[[str], str]):
        """``reader`` itself when no stored key needs renaming (the common case), else the renaming view."""
        return cls(reader, rename) if any(rename(key) != key for key in reader.keys()) else reader

    def keys(self):
        return self._to_stored.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._to_stored

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(self._to_stored[key])

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        return self.reader.read(self._to_stored[key], index)


class RenamedHubKeys:
    """Model mixin (before the family's ``PreTrainedModel``): checkpoints are read with ``hub_key_renames`` applied
    and written with them reversed, as ``transformers`` does for the same class."""

    hub_key_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def load_from_reader(self, reader, *, progress: bool = False, **options):
        to_module = functools.partial(_rename, renames=self.hub_key_renames, to_module=True)
        return super().load_from_reader(RenamedKeyReader.wrap(reader, to_module), progress=progress, **options)

    def full_state_dict(self):
        full = super().full_state_dict()
        if full is None:
            return None
        return {_rename(key, self.hub_key_renames, to_module=False): tensor for key, tensor in full.items()}
