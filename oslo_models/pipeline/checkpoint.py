"""Hub checkpoints and pipeline stages: each stage reads only its own tensors; saving collects all stages.

Loading: ``StageReader`` wraps a ``CheckpointReader`` so that the loader sees only the keys of this rank's
parameters (no "unexpected key" noise for the other stages' layers, and nothing else is read), plus one alias:
a stage holding a copy of a tied tensor under a name the checkpoint lacks (a last stage's ``lm_head.weight``, absent
from tied Hub checkpoints) reads it from a name of the same tied group that is stored (``transformer.wte.weight``),
sliced by its own ``Layout``.

Saving: after the tensor-parallel gather inside each stage, the stage leaders (``dp_rank == tp_rank == 0``:
exactly the pipeline group of global rank 0) send their CPU state dicts to global rank 0 with one
``gather_object`` over the pipeline group, and rank 0 merges them into the single plain state dict it writes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..conversion.checkpoint import CheckpointReader


class StageReader(CheckpointReader):
    """A ``CheckpointReader`` restricted to ``owned`` keys, with ``aliases`` (key -> source key) added."""

    def __init__(self, reader: CheckpointReader, owned: set[str], aliases: dict[str, str]):
        self.reader = reader
        available = set(reader.keys())
        self._aliases = {key: source for key, source in aliases.items() if key not in available and source in available}
        self._keys = [key for key in reader.keys() if key in owned] + list(self._aliases)

    @classmethod
    def for_model(cls, model, reader: CheckpointReader) -> "StageReader":
        """The view of ``reader`` that ``model`` (already cut to its stages) should load from."""
        from .adapter import adapter_for

        prefix = model.base_model_prefix + "." if model.base_model_prefix else ""

        def spellings(name: str) -> tuple[str, str]:  # checkpoints may store the base model without its prefix
            return (name, name[len(prefix):] if prefix and name.startswith(prefix) else prefix + name)

        local = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        owned: set[str] = set()
        for name in local:
            owned.update(spellings(name))
        available = set(reader.keys())
        aliases = {}
        for names in adapter_for(model).tied_groups(model):
            sources = [key for name in names for key in spellings(name) if key in available]
            if not sources:
                continue
            for name in names:  # the loader tries a parameter's own name first: alias that spelling only
                if name in local and not any(key in available for key in spellings(name)):
                    aliases.setdefault(name, sources[0])
        return cls(reader, owned, aliases)

    def keys(self):
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(self._aliases.get(key, key))

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        return self.reader.read(self._aliases.get(key, key), index)


def collect_stage_state_dicts(stage_state: dict[str, torch.Tensor] | None, context
                              ) -> dict[str, torch.Tensor] | None:
    """Merge the stage leaders' state dicts on global rank 0 (``None`` elsewhere).

    Collective over the pipeline group of global rank 0 (``gather_object``, pickled CPU tensors); other ranks
    return at once. Keys are disjoint across stages by construction (tied copies are skipped by the caller).
    """
    if context.dp_rank != 0 or context.tp_rank != 0 or context.cp_rank != 0:  # cp ranks hold replicas, like dp
        return None
    gathered = [None] * context.pp_size if context.rank == 0 else None
    dist.gather_object(stage_state, gathered, dst=0, group=context.pp_group)
    if context.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    return merged
