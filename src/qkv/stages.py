"""The attention pipeline as the seeds teach it, one named function per stage.

    project (X → Q, K, V) → score (Q·Kᵀ) → scale (÷ √d_k) → mask → softmax → weighted sum (· V)
    and, for several heads: split_heads → … → merge_heads (concat) → project (· W_O)

Each stage is a plain NumPy function of already validated arrays. After computing, it calls
:func:`qkv.trace.record` so an active :class:`~qkv.trace.Trace` can observe the result; with no trace that
call does nothing. The reference backend is these stages applied whole; the explainer renders what they
recorded. Shape legend: B batch, H query heads, Hk key/value heads, L query length, S key length,
E query/key width per head, Ev value width per head, D model width, T any sequence length.
"""
from __future__ import annotations

import math

import numpy as np

from .trace import record

#: The value a disallowed score becomes before softmax. ``-inf`` (not a magic ``-1e9``) so that a masked
#: key gets exactly zero weight; :func:`softmax` guards the rows in which every key is masked.
MASKED = -np.inf


def project(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *, name: str = "Q",
            weight_name: str = "W_Q", input_name: str = "X") -> np.ndarray:
    """Linear projection in the seeds' layout: ``x @ w (+ b)``.

    x: (..., T, D_in), w: (D_in, D_out), b: (D_out,) or None  →  (..., T, D_out)
    """
    if x.ndim > 2 and w.ndim == 2:   # one (N, D_in) x (D_in, D_out) matmul, not one per leading index
        out = (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])   # (..., T, D_out)
    else:
        out = x @ w                                              # (T, D_in) x (D_in, D_out) -> (T, D_out)
    if b is not None:
        out = out + b
    bias = f" + b_{weight_name[2:]}" if b is not None else ""
    record(name, "matmul", f"{name} = {input_name} · {weight_name}{bias}", out,
           operands={"a": x, "b": w, "bias": b}, params={"a_name": input_name, "b_name": weight_name})
    return out


def score(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Raw attention scores, every query against every key: ``Q · Kᵀ``.

    q: (..., L, E), k: (..., S, E)  →  (..., L, S)
    """
    s = q @ np.swapaxes(k, -1, -2)                                # (..., L, E) x (..., E, S) -> (..., L, S)
    record("scores", "matmul", "scores = Q · Kᵀ", s, operands={"a": q, "b": k},
           params={"transpose_b": True, "a_name": "Q", "b_name": "K"})
    return s


def scale(scores: np.ndarray, factor: float, *, d_k: int | None = None) -> np.ndarray:
    """Scale the scores: ``scores × factor`` (the seeds' ``÷ √d_k`` when ``factor = 1/√d_k``).

    scores: (..., L, S)  →  (..., L, S)
    """
    s = scores * np.asarray(factor, dtype=scores.dtype)
    default = d_k is not None and math.isclose(factor, 1.0 / math.sqrt(d_k), rel_tol=1e-12)
    formula = "scaled = scores / √d_k" if default else "scaled = scores × scale"
    record("scaled", "scale", formula, s, operands={"scores": scores},
           params={"scale": float(factor), "d_k": d_k, "is_default": default})
    return s


def apply_mask(scaled: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Apply a mask before softmax.

    A boolean mask is True where attention is allowed; a disallowed score becomes ``-inf``.
    A float mask is added to the scores (0 keeps a score, ``-inf`` removes it, other values bias it).
    scaled: (..., L, S), mask: broadcastable to (..., L, S)  →  (..., L, S)
    """
    if mask is None:
        return scaled
    if mask.dtype == np.bool_:
        out = np.where(mask, scaled, np.asarray(MASKED, dtype=scaled.dtype))
        formula = "masked = scaled where mask is True, −∞ elsewhere"
    else:
        out = scaled + mask.astype(scaled.dtype, copy=False)
        formula = "masked = scaled + mask"
    record("masked", "mask", formula, out, operands={"scaled": scaled, "mask": mask})
    return out


def softmax(x: np.ndarray, *, return_lse: bool = False):
    """Row-wise softmax ``exp(x_j − max) / Σ exp(x − max)`` over the last axis.

    A row in which every entry is ``-inf`` (a query that may attend to nothing) becomes all zeros, not NaN.
    x: (..., L, S)  →  (..., L, S), each row summing to 1 (or to 0 for a fully masked row).
    With ``return_lse`` also the row's log-sum-exp ``max + log Σ exp(x − max)`` (..., L), −inf for a fully
    masked row, from the same max and sum.
    """
    m = np.max(x, axis=-1, keepdims=True)                          # (..., L, 1) row max, for stability
    m = np.where(np.isfinite(m), m, 0.0).astype(x.dtype, copy=False)
    e = np.exp(x - m)                                              # (..., L, S) masked entries → exactly 0
    total = np.sum(e, axis=-1, keepdims=True)                      # (..., L, 1)
    w = e / np.where(total == 0, 1, total)
    record("weights", "softmax", "weights = softmax(scaled)", w,
           operands={"logits": x, "exp": e, "sum": total, "max": m})
    if not return_lse:
        return w
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]                            # (..., L); log 0 = −inf
    return w, lse


def dropout(weights: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """Inverted dropout on the attention weights: keep each with probability 1−p, scale kept by 1/(1−p)."""
    keep = rng.random(weights.shape) >= p                          # p = 1 keeps nothing
    factor = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    out = np.where(keep, weights * factor, 0).astype(weights.dtype, copy=False)
    record("dropout", "dropout", f"weights = dropout(weights, p={p})", out,
           operands={"weights": weights, "keep": keep}, params={"p": p})
    return out


def weighted_sum(weights: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Each output row is the weighted sum of the value rows: ``weights · V``.

    weights: (..., L, S), v: (..., S, Ev)  →  (..., L, Ev)
    """
    out = weights @ v                                             # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    record("output", "matmul", "output = weights · V", out, operands={"a": weights, "b": v},
           params={"a_name": "weights", "b_name": "V"})
    return out


def split_heads(x: np.ndarray, num_heads: int, *, name: str = "Q") -> np.ndarray:
    """Split the last axis into heads and move heads forward.

    x: (B, T, H·E)  →  (B, H, T, E)
    """
    B, T, F = x.shape
    out = x.reshape(B, T, num_heads, F // num_heads).transpose(0, 2, 1, 3)   # (B, T, H, E) -> (B, H, T, E)
    record(f"{name}_heads", "reshape", f"{name}_heads = {name}.view(B, T, H, d_k).transpose(1, 2)", out,
           operands={"x": x}, params={"num_heads": num_heads})
    return out


def repeat_kv(x: np.ndarray, n_rep: int, *, name: str = "K") -> np.ndarray:
    """Grouped-query attention: share each key/value head among ``n_rep`` query heads.

    x: (..., Hk, S, E)  →  (..., Hk·n_rep, S, E), head h of the result is head h // n_rep of x
    """
    if n_rep == 1:
        return x
    out = np.repeat(x, n_rep, axis=-3)
    record(f"{name}_repeated", "repeat", f"{name} heads repeated ×{n_rep} (grouped-query)", out,
           operands={"x": x}, params={"n_rep": n_rep})
    return out


def merge_heads(x: np.ndarray) -> np.ndarray:
    """Concatenate the heads back: the inverse of :func:`split_heads`.

    x: (B, H, T, E)  →  (B, T, H·E)
    """
    B, H, T, E = x.shape
    out = x.transpose(0, 2, 1, 3).reshape(B, T, H * E)          # (B, H, T, E) -> (B, T, H, E) -> (B, T, H·E)
    record("concat", "reshape", "concat = output.transpose(1, 2).view(B, T, H·d_k)", out,
           operands={"x": x}, params={"num_heads": H})
    return out


def observe_input(name: str, array: np.ndarray, formula: str | None = None) -> np.ndarray:
    """Record an input (X, W_Q, …) so a rendering of the trace starts from it. Returns it unchanged."""
    record(name, "input", formula or name, array)
    return array
