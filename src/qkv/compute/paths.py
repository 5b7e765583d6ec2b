"""The engine's paths, counted by the engine itself.

Every strategy of the tiled engine (a way of computing a task: the compiled loop, lazy rescaling, bands,
split-K, …) and every compiled kernel it calls is registered here once, at import, with a line saying what
it is; the code of that path calls :func:`hit` with its name when it runs. A test (or a user) counts what a
run took::

    with qkv.paths.counting() as seen:
        qkv.flex_attention(q, k, v, score_mod)
    print(seen)                     # Counter({'forward.lazy': 3, 'kernel.run': 24, ...})
    missing = set(qkv.paths.registered()) - set(seen)

so the differential matrix (``tests/unit/test_matrix.py``) can prove that it walked every path, and a new fast path
cannot land without it walking through that one too.

Counting costs one dictionary update per call of a path (per task or per block), and nothing while no
:func:`counting` block is open. The counts are process-wide (worker threads add to the open blocks' counters
under a lock).
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter

__all__ = ["counting", "describe", "hit", "register", "registered"]

_PATHS: dict[str, str] = {}
_OPEN: list[Counter] = []                 # the counters of the open counting() blocks
_LOCK = threading.Lock()


def register(name: str, doc: str) -> str:
    """Declare the path ``name`` (``"forward.lazy"``, ``"kernel.run_plain"``) with a one-line description;
    returns ``name`` (so a module can keep it as a constant). Registering a name twice with another
    description is a ValueError: two paths may not share a name."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    old = _PATHS.setdefault(name, doc)
    if old != doc:
        raise ValueError(f"path {name!r} is already registered as {old!r}")
    return name


def registered() -> dict[str, str]:
    """Every registered path, name → description (a copy)."""
    return dict(_PATHS)


def describe(name: str) -> str:
    """The description of the registered path ``name``."""
    try:
        return _PATHS[name]
    except KeyError:
        raise ValueError(f"no path named {name!r}; registered: {', '.join(sorted(_PATHS))}") from None


def hit(name: str, n: int = 1) -> None:
    """Count ``n`` runs of the path ``name`` in every open :func:`counting` block (nothing when none is open)."""
    if not _OPEN:
        return
    if name not in _PATHS:
        raise ValueError(f"path {name!r} was not registered (qkv.paths.register)")
    with _LOCK:
        for c in _OPEN:
            c[name] += n


@contextlib.contextmanager
def counting():
    """Count the paths taken inside the block: yields a :class:`collections.Counter` filled as they run."""
    c: Counter = Counter()
    with _LOCK:
        _OPEN.append(c)
    try:
        yield c
    finally:
        with _LOCK:
            _OPEN.remove(c)
