"""Shape arithmetic of attention, once: leading dimensions, grouped-query heads, output shapes.

Legend: B batch, H (= Hq) query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value
width. Arrays are ``query (..., Hq, L, E)``, ``key (..., Hk, S, E)``, ``value (..., Hk, S, Ev)``; the leading
``...`` broadcast. With grouped-query attention (``enable_gqa``) Hk divides Hq and key/value head ``h``
serves query heads ``h·n_rep … (h+1)·n_rep − 1`` (``n_rep = Hq / Hk``), as torch's ``repeat_interleave``.
Every function here takes already validated shapes; :func:`qkv.sdpa.validate` raises the user's errors.
"""
from __future__ import annotations

import math

import numpy as np


def n_rep(query_shape: tuple, key_shape: tuple, enable_gqa: bool) -> int:
    """How many query heads share one key/value head (1 without grouped-query attention)."""
    if not enable_gqa:
        return 1
    return query_shape[-3] // key_shape[-3]


def kv_lead_as_query(query_shape: tuple, key_shape: tuple, enable_gqa: bool) -> tuple:
    """The key's leading dims with its head axis counted in query heads: (..., Hq) under GQA, else as is."""
    if enable_gqa:
        return tuple(key_shape[:-3]) + (query_shape[-3],)
    return tuple(key_shape[:-2])


def lead(query_shape: tuple, key_shape: tuple, enable_gqa: bool) -> tuple:
    """The broadcast leading dims (..., Hq) of the scores and the output. Raises ValueError if they clash."""
    return tuple(np.broadcast_shapes(tuple(query_shape[:-2]), kv_lead_as_query(query_shape, key_shape,
                                                                                  enable_gqa)))


def scores_shape(query_shape: tuple, key_shape: tuple, enable_gqa: bool) -> tuple:
    """(..., Hq, L, S)."""
    return lead(query_shape, key_shape, enable_gqa) + (query_shape[-2], key_shape[-2])


def output_shape(query_shape: tuple, key_shape: tuple, value_shape: tuple, enable_gqa: bool) -> tuple:
    """(..., Hq, L, Ev)."""
    return lead(query_shape, key_shape, enable_gqa) + (query_shape[-2], value_shape[-1])


def kv_lead(lead_shape: tuple, rep: int) -> tuple:
    """The leading dims of the key/value gradients before broadcasting back: (..., Hq/n_rep)."""
    return lead_shape[:-1] + (lead_shape[-1] // rep,) if rep > 1 else tuple(lead_shape)


def kv_index(idx: tuple, rep: int) -> tuple:
    """The leading index of the key/value head serving the query-head index ``idx``."""
    return idx if rep == 1 else idx[:-1] + (idx[-1] // rep,)


def query_heads(kv_idx: tuple, rep: int) -> list[tuple]:
    """The query-head indices served by key/value head ``kv_idx``."""
    if rep == 1:
        return [kv_idx]
    return [kv_idx[:-1] + (kv_idx[-1] * rep + r,) for r in range(rep)]


def n_scores(query_shape: tuple, key_shape: tuple, enable_gqa: bool) -> int:
    """How many numbers the (..., Hq, L, S) scores hold."""
    return math.prod(scores_shape(query_shape, key_shape, enable_gqa))


def source_index(idx: tuple, shape: tuple) -> tuple:
    """Index into an array of leading shape ``shape`` for the broadcast index ``idx`` (right-aligned)."""
    idx = idx[len(idx) - len(shape):] if shape else ()
    return tuple(0 if n == 1 else i for i, n in zip(idx, shape))


def sum_to_shape(a: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``a`` over the axes along which ``shape`` was broadcast to ``a.shape`` (autograd's rule)."""
    extra = a.ndim - len(shape)
    if extra:
        a = a.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and a.shape[i] != 1)
    return a.sum(axis=axes, keepdims=True) if axes else a
