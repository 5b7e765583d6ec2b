"""Merging partial attention results by their log-sum-exp: one implementation.

Attention over keys split in two sets A and B is exact from the two partial results alone: with
``lse_X = log Σ_{j∈X} exp(s_j)`` and ``out_X = Σ_{j∈X} softmax_X(s)_j · v_j``,

    lse = log(exp(lse_A) + exp(lse_B)) = m + log(exp(lse_A − m) + exp(lse_B − m)),  m = max(lse_A, lse_B)
    out = exp(lse_A − lse) · out_A + exp(lse_B − lse) · out_B

(the weights of the two parts sum to 1). A row that saw nothing on one side has ``lse = −∞`` there and takes
the other side unchanged; a row that saw nothing on either side stays ``out = 0``, ``lse = −∞`` (qkv's
convention for a query that may attend to nothing). Subtracting ``m`` first keeps every ``exp`` at most 1,
so nothing overflows whatever the scores. The merge is associative and commutative up to rounding, so key
blocks can be merged in any order: the tiled engine's key blocks, the ring's steps.

Shape legend: ``out`` (..., L, Ev), ``lse`` (..., L).
"""
from __future__ import annotations

import numpy as np

__all__ = ["merge_partials"]


def merge_partials(out_a, lse_a, out_b, lse_b, *, out=None):
    """The attention output and log-sum-exp over the union of two disjoint key sets, from each set's own.

    Args:
        out_a, out_b: (..., L, Ev) partial outputs (each normalized over its own keys; 0 where a row saw none).
        lse_a, lse_b: (..., L) their log-sum-exps (−∞ where a row saw no key).
        out: optional ``(out_array, lse_array)`` to write into (may be ``out_a``/``lse_a`` themselves: the
            ring's accumulators merge in place).

    Returns:
        ``(out, lse)`` in the wider of the input dtypes: ``out`` (..., L, Ev), ``lse`` (..., L).
    """
    lse_a = np.asarray(lse_a)
    lse_b = np.asarray(lse_b)
    out_a = np.asarray(out_a)
    out_b = np.asarray(out_b)
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"merge_partials: expected out (..., L, Ev) and lse (..., L) alike on both sides, got "
                         f"out {out_a.shape} / {out_b.shape}, lse {lse_a.shape} / {lse_b.shape}")
    dt = np.result_type(out_a, out_b, lse_a, lse_b)
    m = np.maximum(lse_a, lse_b)
    dead = np.isneginf(m)                                   # neither side saw a key
    m = np.where(dead, 0.0, m).astype(dt, copy=False)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        wa = np.exp(lse_a - m)                              # ≤ 1; 0 where lse_a = −∞
        wb = np.exp(lse_b - m)
        total = wa + wb                                     # in [1, 2] where alive, 0 where dead
        lse = np.where(dead, -np.inf, m + np.log(np.where(dead, 1.0, total))).astype(dt, copy=False)
        inv = np.where(dead, 0.0, 1.0 / np.where(dead, 1.0, total))
    wa = (wa * inv).astype(dt, copy=False)[..., None]
    wb = (wb * inv).astype(dt, copy=False)[..., None]
    if out is None:
        return (out_a * wa + out_b * wb).astype(dt, copy=False), lse
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(a, np.ndarray) for a in out)):
        raise TypeError(f"out: expected a pair (out_array, lse_array) of numpy arrays, got {type(out).__name__}")
    o, l_ = out
    np.multiply(out_a, wa, out=o)
    o += out_b * wb
    l_[...] = lse
    return o, l_
