"""The backends' registry: name → backend, in registration order (the built-ins first), under one lock.

:func:`register` adds one, :func:`get` finds one by name; :func:`qkv.backends.select` asks them in this order.
"""
from __future__ import annotations

import threading

from qkv.engine.backends.base import Backend, FunctionBackend

#: The registry, name → backend, in registration order (the order ``backend="auto"`` asks them in).
BACKENDS: dict[str, Backend] = {}
_LOCK = threading.Lock()                          # guards BACKENDS and _BUILTIN (registration from any thread)


def register(name: str, backend=None):
    """Add a backend under ``name``: ``register(name, backend_object)``, or as a decorator of a function
    with the older signature (it is wrapped in a :class:`FunctionBackend`)."""
    def add(obj):
        _load_builtin()                               # the built-ins first: auto asks in registration order
        with _LOCK:
            BACKENDS[name] = obj if isinstance(obj, Backend) else FunctionBackend(name, obj)
        return obj
    return add if backend is None else add(backend)


def get(name: str) -> Backend:
    """The backend called ``name``; a ValueError lists the known names otherwise."""
    _load_builtin()
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a string, one of {sorted(BACKENDS)}, got {type(name).__name__}")
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {name!r}") from None


def names() -> list[str]:
    _load_builtin()
    return sorted(BACKENDS)


def name_of(backend) -> str:
    """The registry's name of ``backend`` (an entry :func:`select` returned)."""
    name = getattr(backend, "name", None)
    if isinstance(name, str) and BACKENDS.get(name) is backend:
        return name
    return next((n for n, b in BACKENDS.items() if b is backend), str(name))


_BUILTIN: dict[str, Backend] = {}


def _load_builtin() -> None:
    if _BUILTIN:
        return
    from qkv.engine.backends.reference import REFERENCE
    from qkv.engine.backends.tiled import TILED
    from qkv.engine.backends.torch_backend import TORCH                     # importing it does not import torch
    with _LOCK:
        for name, b in (("reference", REFERENCE), ("tiled", TILED), ("torch", TORCH)):
            BACKENDS.setdefault(name, b)
            _BUILTIN.setdefault(name, b)
