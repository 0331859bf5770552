"""Where training checkpoints live on disk, so that no crash at any instant loses the last complete one.

    <path>/
      latest                 "step-00000200": the newest complete checkpoint (replaced atomically)
      step-00000100/         complete: oslo_checkpoint.txt written last, after every rank's files are fsynced
                             and checksums.json (size and SHA-256 of every file, see checkpoint_integrity)
      step-00000200/
      .step-00000300.partial being written (never read)

A save writes ``.step-N.partial``, fsyncs it, renames it to ``step-N`` (an atomic exchange when re-saving the same
step), then points ``latest`` at it (temp file + ``os.replace``), and only then removes older step folders
beyond ``keep``. At every instant ``latest`` names a complete folder, or (after a crash between the rename and the
pointer) an older complete folder; the loader also falls back to the newest complete ``step-*`` folder when
``latest`` is missing or broken. This is Megatron's ``latest_checkpointed_iteration.txt`` and torchtitan's
``step-N`` folders, with the completeness marker DCP users add by hand.

A folder holding the marker itself (the single-folder layout of earlier versions) is still read as is.
"""
from __future__ import annotations

import os
import re
import shutil

from ..conversion.atomic import publish_dir, recover_folder, write_text_atomic

MARKER = "oslo_checkpoint.txt"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def partial_dir(path: str, step: int) -> str:
    """The staging folder every rank writes into for the save of ``step`` (same name on every rank)."""
    return os.path.join(path, f".{step_dir_name(step)}.partial")


def is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER))


def _step_folders(path: str) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir(path):
        match = _STEP_DIR.match(entry)
        if match and os.path.isdir(os.path.join(path, entry)):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def find_checkpoint(path: str | os.PathLike) -> str | None:
    """The newest complete checkpoint folder under ``path`` (or ``path`` itself in the single-folder layout);
    ``None`` when ``path`` does not exist or holds none. Never writes."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    if is_complete(path):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as handle:
            name = handle.read().strip()
        if _STEP_DIR.match(name) and is_complete(os.path.join(path, name)):
            return os.path.join(path, name)
    complete = [name for _, name in _step_folders(path) if is_complete(os.path.join(path, name))]
    return os.path.join(path, complete[-1]) if complete else None


def older_complete(path: str, folder: str) -> list[str]:
    """The complete ``step-N`` folders under ``path`` older than ``folder``, newest first (where a load falls back
    to when ``folder`` is corrupt). Never a newer step: that could be another run's left in the same folder."""
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    match = _STEP_DIR.match(os.path.basename(folder))
    if not match or os.path.dirname(folder) != path:
        return []
    step = int(match.group(1))
    return [os.path.join(path, name) for number, name in reversed(_step_folders(path))
            if number < step and is_complete(os.path.join(path, name))]


def remove_partial(path: str, step: int) -> None:
    """Rank 0, after a failed save (every rank has stopped writing): free what the partial folder holds."""
    shutil.rmtree(partial_dir(path, step), ignore_errors=True)


def describe_missing(path: str) -> str:
    """Why :func:`find_checkpoint` found nothing, for the error message."""
    if not os.path.exists(path):
        return f"{path} does not exist"
    if not os.path.isdir(path):
        return f"{path} is a file, not a checkpoint folder"
    entries = sorted(os.listdir(path))
    partial = [entry for entry in entries if entry.endswith(".partial")]
    text = f"{path} holds no complete oslo_models training checkpoint (a step-N folder with {MARKER})"
    if partial:
        text += f"; only interrupted saves: {partial}"
    elif entries:
        text += f"; it holds {entries[:8]}"
    return text


def publish_step(path: str, step: int, *, keep: int = 1, checksums: dict | None = None) -> str:
    """Rank 0, after every rank's files are in ``partial_dir(path, step)``: record ``checksums`` (see
    ``checkpoint_integrity``), mark complete, publish, point ``latest`` at it, remove older step folders beyond
    ``keep`` and stale partial folders. Returns the folder."""
    partial = partial_dir(path, step)
    name = step_dir_name(step)
    if checksums is not None:
        from .checkpoint_integrity import write_checksums

        write_checksums(partial, checksums)
    with open(os.path.join(partial, MARKER), "w", encoding="utf-8") as handle:
        handle.write(f"complete oslo_models training checkpoint, step {int(step)}\n")
    final = os.path.join(path, name)
    recover_folder(final)
    pointer = os.path.join(path, LATEST)
    previous = os.path.basename(find_checkpoint(path) or "") if os.path.isfile(pointer) else ""
    publish_dir(partial, final)  # fsyncs the tree first; replaces a same-step folder atomically
    try:
        write_text_atomic(pointer, name + "\n")
    except BaseException:
        # e.g. the folder's fsync after the rename failed: the save raises, so `latest` must go on naming the
        # previous step (the new folder stays, complete, for the next save of this step to replace)
        if _STEP_DIR.match(previous) and previous != name:
            try:
                write_text_atomic(pointer, previous + "\n")
            except OSError:
                pass
        raise
    others = [entry for _, entry in _step_folders(path) if entry != name]
    for entry in others[: max(0, len(others) - (keep - 1))]:
        shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
    for entry in os.listdir(path):
        if entry.startswith(".step-") and (entry.endswith(".partial") or ".previous-" in entry):
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
    return final


def prepare_partial(path: str, step: int) -> None:
    """Rank 0, before a save: the root folder exists and no stale partial folder of this step is left."""
    if os.path.isfile(path):
        raise ValueError(f"save_checkpoint path {path!r} is a file, not a folder")
    os.makedirs(path, exist_ok=True)
    if is_complete(path):
        raise ValueError(f"{path} is a checkpoint in the single-folder layout of an earlier version; save into a "
                         "new folder (it keeps step-N subfolders and a 'latest' pointer)")
    shutil.rmtree(partial_dir(path, step), ignore_errors=True)
