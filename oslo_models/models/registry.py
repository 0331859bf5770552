"""The family records: found in the subpackages of ``oslo_models.models``, plus those registered at run time.

Every folder under ``oslo_models/models`` with a ``FAMILIES`` tuple in its ``__init__.py`` contributes its records
(``models/roberta`` holds ``roberta``, ``xlm-roberta`` and ``camembert``). Discovery runs on first use and imports
only those ``__init__`` files, which import no model code (see ``models/family.py``).

``register_family(record)`` adds a model type from outside the tree, as ``transformers``' ``AutoModel.register``
does: the registered records are this module's one piece of mutable state (the in-tree ones are found once and
cached). The Auto classes, ``oslo_models``' public names and the test zoo all read it.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

from .family import TASKS, FamilyRecord

# subpackages of oslo_models.models that hold shared code, not families (their __init__ imports torch)
_NOT_FAMILIES = frozenset({"common"})

_registered: dict[str, FamilyRecord] = {}  # model_type -> record added by register_family


@functools.cache
def in_tree_families() -> tuple[FamilyRecord, ...]:
    """The records declared by this package's family folders (``FAMILIES``), in folder order; found once."""
    found: dict[str, FamilyRecord] = {}
    for info in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        if not info.ispkg or info.name in _NOT_FAMILIES:
            continue
        for record in getattr(importlib.import_module(f"{__package__}.{info.name}"), "FAMILIES", ()):
            if record.model_type in found:
                raise RuntimeError(f"model type {record.model_type!r} is declared by both "
                                   f"{found[record.model_type].package} and {record.package}")
            found[record.model_type] = record
    return tuple(found.values())


def _records() -> dict[str, FamilyRecord]:
    return {**{record.model_type: record for record in in_tree_families()}, **_registered}


def families() -> tuple[FamilyRecord, ...]:
    """Every record: the in-tree ones (in folder order), then the registered ones (in registration order)."""
    return tuple(_records().values())


def register_family(record: FamilyRecord, *, exist_ok: bool = False) -> FamilyRecord:
    """Add ``record`` so the Auto classes build its ``model_type`` (``AutoModelForCausalLM.from_config(cfg)``).

    ``ValueError`` if that model type is already known, unless ``exist_ok`` and it is the same record (registering
    twice, e.g. from a module imported twice, is then harmless)."""
    if not isinstance(record, FamilyRecord):
        raise TypeError(f"register_family takes a FamilyRecord, got {type(record).__name__}")
    known = _records().get(record.model_type)
    if known is not None:
        if exist_ok and known == record:
            return known
        raise ValueError(f"model type {record.model_type!r} is already registered (by {known.package})")
    _registered[record.model_type] = record
    return record


def unregister_family(model_type: str) -> None:
    """Remove a record added by :func:`register_family` (tests clean up with it); in-tree records stay."""
    if model_type not in _registered and model_type in _records():
        raise ValueError(f"model type {model_type!r} is an in-tree family; it cannot be unregistered")
    _registered.pop(model_type, None)


def family_record(model_type: str) -> FamilyRecord:
    """The record of ``model_type``; ``ValueError`` naming the supported types if there is none."""
    records = _records()
    if model_type not in records:
        raise ValueError(f"Unsupported model type {model_type!r}; supported: {sorted(records)}")
    return records[model_type]


def supported_model_types(task: str) -> list[str]:
    """The model types with a class for ``task``, sorted."""
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; tasks are {list(TASKS)}")
    return sorted(t for t, record in _records().items() if task in record.classes)


def model_class(task: str, model_type: str, *, owner: str | None = None) -> type:
    """The class that builds ``model_type`` for ``task``. ``ValueError`` ("Unsupported model type ...", naming
    ``owner`` (e.g. the Auto class) or the task, and the supported types) if no record has one."""
    record = _records().get(model_type)
    if record is None or task not in record.classes:
        raise ValueError(f"Unsupported model type {model_type!r} for {owner or task}; supported: "
                         f"{supported_model_types(task)}")
    return record.model_class(task)


def task_table(task: str) -> dict[str, type]:
    """``{model_type: class}`` for ``task`` (imports every family that has one; for inspection and tests)."""
    return {model_type: model_class(task, model_type) for model_type in supported_model_types(task)}
