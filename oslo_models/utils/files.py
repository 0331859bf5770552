"""Crash-safe file writes shared by the data files (``.bin``/``.idx``) and the checkpoint pointers."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_file(path, write_fn, *, mode: int = 0o644) -> None:
    """Call ``write_fn(binary file)`` on a temp file next to ``path``, fsync it, rename it over ``path``, then
    fsync the folder so the rename itself survives a power cut. Readers see the old file or the new one, never
    a part. ``mode``: mkstemp makes 0600 files; data and checkpoints are usually read by other users and jobs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as handle:
            write_fn(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(error, OSError) and error.errno is not None and error.filename is None:  # name the file
            error.filename = str(path)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    except OSError as error:
        if error.errno is not None and error.filename is None:
            error.filename = str(path.parent)
        raise
    finally:
        os.close(dir_fd)
