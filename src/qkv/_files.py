"""Writing files whole or not at all: one helper for every file qkv writes (pictures, pages, plots, JSON).

:func:`atomic_write` opens a temporary file in the target's folder; on success it replaces the target
(``os.replace``, atomic on one file system), on any failure (an exception, MemoryError, Ctrl-C) it is removed.
A reader sees the old file or the whole new one, never an empty or half-written one.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

__all__ = ["atomic_write"]


def _default_mode() -> int:
    """The permission bits a new file gets here (0o666 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb", **kw):
    """Open a temporary file in ``path``'s folder for writing; on success it replaces ``path``, on any failure
    it is removed (see the module). The new file gets the usual permissions (those of the file it replaces,
    else 0o666 less the umask), not mkstemp's 0600. ``mode`` and ``kw`` are :func:`open`'s ("w" with
    ``encoding=`` for text). OSError (naming the folder) when the folder cannot take the file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kw) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        try:
            perm = os.stat(path).st_mode & 0o7777
        except OSError:
            perm = _default_mode()
        os.chmod(tmp, perm)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
