"""The engine's configuration: one value, :class:`Settings` (GEMM provider, block kernels, worker threads,
limits), in ONE context variable over one process default.

* :func:`current` — the settings in force here: the innermost :func:`override` of this context (thread, task)
  over the process default. A field None in an override is not overridden; a field None in the process default
  means "not set": the GEMM's and the kernels' first choice from the environment (``QKV_GEMM``,
  ``QKV_KERNELS``, read by :mod:`qkv.gemm` / :mod:`qkv.kernels`), the available cores, the engine's
  :class:`~qkv.backends.tiled.Limits` defaults.
* :func:`override` — a ``with`` block in which some fields take other values; nested blocks compose (the inner
  one over the outer one); other threads and tasks keep theirs. A thread or task started inside sees the block's
  values when it runs in a copy of the context, as the engine's workers do
  (:meth:`qkv.backends.runtime.Runtime.run`).
* :func:`set_default` — the process default (what ``qkv.set_gemm``, ``qkv.set_kernels``, ``qkv.set_num_threads``
  write), under a lock.

This module validates nothing (it sits below the modules that know the names): :func:`qkv.config` does, and
:mod:`qkv.gemm` / :mod:`qkv.kernels` / :mod:`qkv.backends.runtime` before they write. It imports nothing of qkv.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading

__all__ = ["Settings", "current", "override", "process_default", "set_default"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The engine's configuration. ``gemm``: ``"auto"``, ``"numpy"`` or ``"mkl"``; ``kernels``: ``"auto"``,
    ``"numpy"`` or ``"numba"``; ``threads``: the tiled engine's workers; ``limits``: a
    :class:`qkv.backends.tiled.Limits`. None: not set (see the module docstring)."""
    gemm: str | None = None
    kernels: str | None = None
    threads: int | None = None
    limits: object = None


_FIELDS = tuple(f.name for f in dataclasses.fields(Settings))


class _Layer:
    """An override in the context variable: its fields, and the last merge with a process default (a memo:
    :func:`current` runs on every matmul)."""

    __slots__ = ("fields", "memo")

    def __init__(self, fields: dict):
        self.fields = fields
        self.memo = None                                  # (process default, merged Settings)


class _Process:
    """The process default, replaced whole under a lock (readers take the reference without one)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.settings = Settings()


_PROCESS = _Process()
#: The one context variable: None, or the innermost override (a _Layer holding the composed fields).
_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("qkv_config", default=None)


def process_default() -> Settings:
    """The process default (fields None where not set)."""
    return _PROCESS.settings


def set_default(**fields) -> Settings:
    """Write fields of the process default (None: back to not set); returns the new default."""
    _check_names(fields)
    with _PROCESS.lock:
        _PROCESS.settings = dataclasses.replace(_PROCESS.settings, **fields)
        return _PROCESS.settings


def current() -> Settings:
    """The settings in force in this context: the innermost override over the process default."""
    base = _PROCESS.settings
    layer = _CONTEXT.get()
    if layer is None:
        return base
    memo = layer.memo
    if memo is not None and memo[0] is base:
        return memo[1]
    merged = dataclasses.replace(base, **layer.fields)
    layer.memo = (base, merged)
    return merged


def overrides() -> dict:
    """The fields the overrides in force here set (the process default's are not among them)."""
    layer = _CONTEXT.get()
    return {} if layer is None else dict(layer.fields)


@contextlib.contextmanager
def override(**fields):
    """Within the block, the given fields (those not None) take these values in this context; yields
    :func:`current`."""
    _check_names(fields)
    outer = _CONTEXT.get()
    composed = dict(outer.fields) if outer is not None else {}
    composed.update({k: v for k, v in fields.items() if v is not None})
    token = _CONTEXT.set(_Layer(composed))
    try:
        yield current()
    finally:
        _CONTEXT.reset(token)


def _check_names(fields: dict) -> None:
    bad = sorted(set(fields) - set(_FIELDS))
    if bad:
        raise TypeError(f"config: unknown {', '.join(bad)}; expected some of {', '.join(_FIELDS)}")
