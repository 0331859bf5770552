"""Old Hub checkpoints (BERT-era TensorFlow conversions, e.g. ``bert-base-uncased``) name LayerNorm parameters
``gamma``/``beta``. ``transformers`` renames them on load (its "legacy" conversion mapping); this reader view does
the same so the sliced loader finds them, without touching the checkpoint or reading anything early."""
from __future__ import annotations

import torch

_LEGACY = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))


def _modern(key: str) -> str:
    for old, new in _LEGACY:
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


class LegacyKeyReader:
    """A ``CheckpointReader`` seen with ``LayerNorm.gamma/beta`` renamed to ``LayerNorm.weight/bias``."""

    def __init__(self, reader):
        self.reader = reader
        self._to_stored = {_modern(key): key for key in reader.keys()}

    @classmethod
    def wrap(cls, reader):
        """``reader`` itself when no key needs renaming (the common case), else the renaming view."""
        return cls(reader) if any(_modern(key) != key for key in reader.keys()) else reader

    def keys(self):
        return self._to_stored.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._to_stored

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(self._to_stored[key])

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        return self.reader.read(self._to_stored[key], index)
