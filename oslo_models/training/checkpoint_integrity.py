"""Checksums of training checkpoints: a truncated or bit-flipped file is found before any state is loaded.

A save records ``checksums.json`` in the step folder (before the completeness marker): the size and SHA-256 of
every file in it (DCP data and metadata, ``trainer_state.pt``, ``rng/rank<k>.pt``). The work is shared: with the
folder's files in sorted order, rank ``k`` hashes files ``k, k + world, ...``, and one ``all_gather_object`` brings
the table to rank 0, which writes it. A load verifies the same way (each rank re-hashes its share) *before* reading
any tensor, and every rank raises the same :class:`CorruptCheckpointError` naming the first bad file and what is
wrong with it (missing, truncated/extended, or its content changed). ``load_checkpoint(..., fallback=True)`` then
tries the next older complete step instead, saying so loudly.

Folders saved before checksums existed (no ``checksums.json``) are loaded unverified.
"""
from __future__ import annotations

import hashlib
import json
import os

from ..distributed.agreement import agree_on_failure

CHECKSUMS = "checksums.json"
_CHUNK = 8 * 1024 * 1024


class CorruptCheckpointError(ValueError):
    """A file of a training checkpoint is missing, has another size, or another content than when it was saved."""


def checkpoint_files(folder: str, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """Every file under ``folder`` as a sorted list of ``/``-separated relative paths, without ``exclude``."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if relative not in exclude:
                found.append(relative)
    return sorted(found)


def digest(path: str) -> tuple[int, str]:
    """``(size in bytes, SHA-256 hex)`` of one file, read in 8 MiB chunks."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            sha.update(chunk)
    return size, sha.hexdigest()


def _share(files: list[str], context) -> list[str]:
    return files[context.rank::context.world_size]


def record_checksums(context, folder: str, *, exclude: tuple[str, ...], what: str, group=None) -> dict[str, list]:
    """``{relative path: [size, sha256]}`` of every file in ``folder``; every rank hashes its share. Collective
    (one ``all_gather_object``, over ``group`` when given); an unreadable file is every rank's error."""
    error, table = None, {}
    try:
        for relative in _share(checkpoint_files(folder, exclude=exclude), context):
            table[relative] = list(digest(os.path.join(folder, relative)))
    except Exception as caught:  # noqa: BLE001 - re-raised on every rank by agree_on_failure
        error = caught
    merged = {}
    for part in agree_on_failure(context, error, what=what, value=table, group=group):
        merged.update(part)
    return dict(sorted(merged.items()))


def write_checksums(folder: str, table: dict[str, list]) -> None:
    """Rank 0: ``folder/checksums.json`` (written and fsynced before the completeness marker)."""
    from ..conversion.atomic import fsync_path

    path = os.path.join(folder, CHECKSUMS)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"algorithm": "sha256", "files": table}, handle, indent=1, sort_keys=True)
    fsync_path(path)


def _problem(folder: str, relative: str, expected: list) -> str | None:
    path = os.path.join(folder, relative)
    if not os.path.isfile(path):
        return f"{path}: missing"
    size = os.path.getsize(path)
    if size != expected[0]:
        kind = "truncated" if size < expected[0] else "longer than saved"
        return f"{path}: {kind} ({size} bytes, {expected[0]} when saved)"
    if digest(path)[1] != expected[1]:
        return f"{path}: its content changed since the save (SHA-256 differs: a flipped bit or an overwrite)"
    return None


def verify_checksums(context, folder: str) -> bool:
    """Check every file of ``folder`` against its ``checksums.json`` before anything is loaded; every rank
    re-hashes its share. Raises :class:`CorruptCheckpointError` on every rank naming the bad file(s); returns
    ``False`` (nothing checked) for a folder saved without checksums. Collective (one ``all_gather_object``)."""
    table_path = os.path.join(folder, CHECKSUMS)
    error, problems = None, []
    try:
        if os.path.isfile(table_path):
            with open(table_path, encoding="utf-8") as handle:
                table = json.load(handle)["files"]
            for relative in _share(sorted(table), context):
                problem = _problem(folder, relative, table[relative])
                if problem:
                    problems.append(problem)
    except Exception as caught:  # noqa: BLE001 - an unreadable table is corruption too; agreed below
        error = CorruptCheckpointError(f"{table_path}: unreadable ({type(caught).__name__}: {caught})")
    found = agree_on_failure(context, error, what=f"verifying {folder}", value=(os.path.isfile(table_path),
                                                                               problems))
    bad = [problem for _, mine in found for problem in mine]
    if bad:
        more = f" (and {len(bad) - 1} more: {bad[1:4]})" if len(bad) > 1 else ""
        raise CorruptCheckpointError(f"corrupt checkpoint {folder}: {bad[0]}{more}")
    return all(has for has, _ in found)
