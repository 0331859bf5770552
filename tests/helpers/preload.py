"""What the pool's fork server imports before it forks a rank (``dist_pool.PRELOAD``): the test helpers and every
in-tree family's classes with their ``transformers`` twins (``transformers`` loads a model's module on first use)."""
from __future__ import annotations

from oslo_models.models.registry import families
from tests.helpers import composition, dist, dropout, layouts, models, ops, pipeline  # noqa: F401

for _record in families():
    for _task in _record.classes:
        _cls = _record.model_class(_task)
        getattr(_cls, "hf_twin", None)
