"""A full disk on demand: every write of a save, one at a time, fails with ``OSError(ENOSPC)``.

``WriteFaults(fail_at=k)`` is a context manager for one process. While active it counts the *write sites* of the
process, in order: each file opened for writing (``open``/``io.open``/``os.fdopen``/``Path.open``, which DCP, the
pointer files and the config files use), each ``torch.save`` / ``safetensors.torch.save_file`` straight to a path
(native writers that bypass Python's ``open``), each ``os.pwrite`` (the distributed Hub export's writes at offsets),
each ``os.mkdir`` (no free inodes) and each ``os.fsync`` (where a network file system reports a deferred write
error). At site ``k`` the disk is full: a file write (or ``pwrite``) stores half of its data and raises, a native
writer leaves half a file and raises, ``mkdir``/``fsync`` raise. ``fail_at=-1``
only counts (``.sites``: ``"kind path"`` per site).

This is fault injection for tests (like ``kill_driver.py``'s kill points), not a patch of the library: the library
code runs unchanged and meets the error where a real full disk would raise it.
"""
from __future__ import annotations

import builtins
import errno
import io
import os

import safetensors.torch
import torch


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path) if path is not None else None)


class _FullFile:
    """A file object whose next write stores half of its data, then fails with ENOSPC."""

    def __init__(self, handle, path):
        self._handle, self._path = handle, path

    def write(self, data):
        view = memoryview(data).cast("B") if not isinstance(data, str) else data
        self._handle.write(view[: len(view) // 2])
        self._handle.flush()
        raise _enospc(self._path)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()
        return False

    def __iter__(self):
        return iter(self._handle)


def _writes(mode) -> bool:
    return isinstance(mode, str) and any(flag in mode for flag in "wax+")


class WriteFaults:
    """See the module docstring."""

    def __init__(self, fail_at: int = -1):
        self.fail_at = fail_at
        self.sites: list[str] = []
        self._saved = []

    def _site(self, kind: str, path) -> bool:
        """Count a site; whether it is the one that fails."""
        self.sites.append(f"{kind} {os.path.basename(os.fspath(path)) if path is not None else '?'}")
        return len(self.sites) - 1 == self.fail_at

    def __enter__(self):
        real_open, real_save, real_save_file = io.open, torch.save, safetensors.torch.save_file
        real_mkdir, real_fsync, real_pwrite = os.mkdir, os.fsync, os.pwrite
        faults = self

        def open_(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if _writes(mode) and faults._site("open", file if not isinstance(file, int) else None):
                return _FullFile(handle, file if not isinstance(file, int) else None)
            return handle

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and faults._site("torch.save", f):
                real_save(obj, f, *args, **kwargs)
                os.truncate(f, os.path.getsize(f) // 2)
                raise _enospc(f)
            return real_save(obj, f, *args, **kwargs)

        def save_file(tensors, filename, *args, **kwargs):
            if faults._site("save_file", filename):
                real_save_file(tensors, filename, *args, **kwargs)
                os.truncate(filename, os.path.getsize(filename) // 2)
                raise _enospc(filename)
            return real_save_file(tensors, filename, *args, **kwargs)

        def mkdir(path, *args, **kwargs):
            if faults._site("mkdir", path):
                raise _enospc(path)
            return real_mkdir(path, *args, **kwargs)

        def pwrite(fd, data, offset):
            if faults._site("pwrite", os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else None):
                view = memoryview(data).cast("B")
                real_pwrite(fd, view[: len(view) // 2], offset)
                raise _enospc(None)
            return real_pwrite(fd, data, offset)

        def fsync(fd):
            if faults._site("fsync", None):
                raise _enospc(None)
            return real_fsync(fd)

        for owner, name, value in ((builtins, "open", open_), (io, "open", open_), (torch, "save", save),
                                   (safetensors.torch, "save_file", save_file), (os, "mkdir", mkdir),
                                   (os, "fsync", fsync), (os, "pwrite", pwrite)):
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        return self

    def __exit__(self, *exc):
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        return False
