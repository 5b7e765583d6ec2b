"""Writing outputs as Unix tools do, whole or not at all: one helper for every file qkv writes (pictures, pages,
plots, JSON).

:func:`atomic_write` writes by what is at the path (:func:`output_kind`):

* a regular file, or nothing yet: a temporary file in the target's folder, which on success replaces the target
  (``os.replace``, atomic on one file system) and on any failure (an exception, MemoryError, Ctrl-C) is removed —
  a reader sees the old file or the whole new one, never an empty or half-written one;
* a symbolic link: its target is written so (the link stays a link; a dangling link's target is created);
* ``-``: standard output; a FIFO, a character or block device, a socket (``/dev/null``, ``/dev/stdout``, a pipe's
  reader): opened and written to directly, never replaced.

Where the output is written directly, what the caller writes is held in memory until it is done: a failure
writes nothing at all.
"""
from __future__ import annotations

import contextlib
import io
import os
import stat
import sys
import tempfile

__all__ = ["atomic_write", "output_kind"]


def output_kind(path) -> str:
    """How :func:`atomic_write` writes ``path``: ``"stdout"`` (``-``), ``"stream"`` (a FIFO, device or socket — a
    link to one too: written to directly) or ``"file"`` (a regular file, a new path, or a link to either:
    replaced atomically)."""
    path = os.fspath(path)
    if path == "-":
        return "stdout"
    try:
        mode = os.stat(path).st_mode                          # (follows a link: what it points at)
    except OSError:
        return "file"
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        return "stream"
    return "file"


def _default_mode() -> int:
    """The permission bits a new file gets here (0o666 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb", **kw):
    """Open ``path`` for writing as the module says: a regular file (or a link's target) through a temporary file
    in its folder that replaces it on success and is removed on any failure; ``-``, a FIFO or a device written to
    directly once the caller is done (nothing on a failure). A new file gets the usual permissions (those of the
    file it replaces, else 0o666 less the umask), not mkstemp's 0600. ``mode`` and ``kw`` are :func:`open`'s ("w"
    with ``encoding=`` for text). OSError (naming the folder) when the folder cannot take the file."""
    path = os.fspath(path)
    kind = output_kind(path)
    if kind != "file":
        buf = io.BytesIO() if "b" in mode else io.StringIO()
        yield buf                                              # (an exception here: nothing is written)
        _write_through(path, kind, mode, buf.getvalue(), kw)
        return
    if os.path.islink(path):                                   # the link's target, the link kept
        path = os.path.realpath(path)
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


def _write_through(path: str, kind: str, mode: str, data, kw: dict) -> None:
    """``data`` to standard output or straight into the FIFO or device at ``path``."""
    if kind == "stdout":
        out = sys.stdout.buffer if "b" in mode else sys.stdout
        out.write(data)
        out.flush()
        return
    with open(path, "wb" if "b" in mode else "w", **kw) as fh:
        fh.write(data)
