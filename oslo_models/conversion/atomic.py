"""Crash-safe publishing of folders and small files: stage, fsync, then one atomic rename.

Used by both save paths (``save_pretrained``'s Hub folder and ``training.save_checkpoint``). The rules:

- everything is written into a staging sibling (same file system, so renames are atomic), created with the mode a
  plain ``mkdir`` gives (0755 under umask 022), not ``mkdtemp``'s 0700;
- file contents and the staging folder's entries are flushed to disk (``fsync``) *before* the rename that makes
  them visible, and the parent folder after it, so a power cut cannot publish a folder of empty files;
- replacing an existing folder is one ``renameat2(RENAME_EXCHANGE)`` on Linux: the target path always names a
  complete folder, the old one or the new one. Where the kernel or file system lacks it, two renames run with the
  old folder kept under ``.<name>.previous-*`` until the new one is in place, and :func:`recover_folder` puts it
  back if a crash fell between them.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid

from ..utils.files import atomic_write_file

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_path(path: str) -> None:
    """Flush a file's data, or a folder's entries, to disk (a no-op where folders cannot be opened)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:  # some file systems refuse fsync on folders
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            if error.filename is None:  # which file a deferred write error (ENOSPC, EIO) belongs to
                error.filename = path
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and folder under ``root`` (files first, each folder after its entries)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def make_staging_dir(target: str, tag: str = "saving") -> str:
    """A new empty sibling ``.<name>.<tag>-<random>`` of ``target``, with the umask's usual mode."""
    parent, name = os.path.split(os.path.abspath(target).rstrip(os.sep))
    os.makedirs(parent, exist_ok=True)
    while True:
        path = os.path.join(parent, f".{name}.{tag}-{uuid.uuid4().hex[:10]}")
        try:
            os.mkdir(path)  # mode 0o777 & ~umask, like transformers' own os.makedirs
            return path
        except FileExistsError:
            continue


def remove_stale_staging(target: str) -> None:
    """Remove staging folders a killed save of ``target`` left behind (``.<name>.saving-*``); call before a save."""
    parent, name = os.path.split(os.path.abspath(target).rstrip(os.sep))
    if os.path.isdir(parent):
        for entry in os.listdir(parent):
            if entry.startswith(f".{name}.saving-"):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); ``False`` where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the running process's symbols: libc on Linux
    except OSError:
        return False
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(code)}")


def publish_dir(staging: str, target: str) -> None:
    """Make the complete folder ``staging`` appear at ``target``, replacing any folder there atomically.

    ``staging`` must be a sibling of ``target``. Its contents are fsynced first and the parent after."""
    parent = os.path.dirname(os.path.abspath(target))
    fsync_tree(staging)
    if not os.path.isdir(target):
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # staging now holds the previous folder
    else:
        previous = make_staging_dir(target, "previous")
        os.rmdir(previous)
        os.rename(target, previous)  # a crash right here: recover_folder(target) renames it back
        os.rename(staging, target)
        fsync_path(parent)
        shutil.rmtree(previous, ignore_errors=True)
    fsync_path(parent)


def recover_folder(target: str) -> bool:
    """After a crash between the two fallback renames of :func:`publish_dir`: put the kept previous folder back
    at ``target`` when ``target`` is missing. Returns whether it did."""
    if os.path.exists(target):
        return False
    parent, name = os.path.split(os.path.abspath(target).rstrip(os.sep))
    if not os.path.isdir(parent):
        return False
    kept = sorted(entry for entry in os.listdir(parent) if entry.startswith(f".{name}.previous-"))
    if not kept:
        return False
    os.rename(os.path.join(parent, kept[-1]), target)
    fsync_path(parent)
    return True


def write_text_atomic(path: str, text: str) -> None:
    """Replace the small file ``path`` with ``text`` atomically (temp file, fsync, ``os.replace``, fsync folder)."""
    atomic_write_file(path, lambda handle: handle.write(text.encode("utf-8")))
