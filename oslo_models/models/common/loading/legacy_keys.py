"""Old Hub checkpoints (BERT-era TensorFlow conversions, e.g. ``bert-base-uncased``) name LayerNorm parameters
``gamma``/``beta``. ``transformers`` renames them on load (its "legacy" conversion mapping); this reader view does
the same so the sliced loader finds them, without touching the checkpoint or reading anything early."""
from __future__ import annotations

from .renamed_keys import RenamedKeyReader

_LEGACY = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))


def _modern(key: str) -> str:
    for old, new in _LEGACY:
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def legacy_key_view(reader):
    """``reader`` seen with ``LayerNorm.gamma/beta`` renamed to ``LayerNorm.weight/bias`` (``reader`` itself when no
    key is old)."""
    return RenamedKeyReader.wrap(reader, _modern)
