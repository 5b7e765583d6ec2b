"""Backends of :func:`qkv.scaled_dot_product_attention`, in one registry with one signature.

Every backend is called as::

    fn(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng, return_weights,
       return_lse=False, threads=None)
        -> (output, weights or None), or (output, weights or None, lse) when return_lse

where ``lse`` (..., Hq, L) is the log-sum-exp of each row of the masked, scaled scores (−inf for a row
that may attend to nothing), in the compute dtype (float32 for float16 inputs), and ``threads`` (a positive
int or None) is for backends with their own workers (the tiled engine); the others ignore it. Callers pass
the two optional ones only when set, so a backend written for the shorter signature keeps working.

with arguments already validated by :func:`qkv.attention.scaled_dot_product_attention`: ``scale`` is a
float, ``attn_mask`` is None or a bool/float array broadcastable to ``(..., Hq, L, S)``, ``is_causal`` and
``attn_mask`` are never both set. Register one with :func:`register`.
"""
from __future__ import annotations

from typing import Callable

BACKENDS: dict[str, Callable] = {}


def register(name: str):
    """Decorator: add a backend under ``name``."""
    def deco(fn):
        BACKENDS[name] = fn
        return fn
    return deco


def get(name: str) -> Callable:
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


def _load_builtin() -> None:
    from . import reference  # noqa: F401  (registers "reference")
    try:
        from . import tiled  # noqa: F401  (registers "tiled")
    except ImportError:
        pass
    try:
        from . import torch_backend  # noqa: F401  (registers "torch"; importing it does not import torch)
    except ImportError:
        pass
