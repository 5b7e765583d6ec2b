"""The attention pipeline as the seeds teach it, one named function per stage.

    project (X → Q, K, V) → score (Q·Kᵀ) → scale (÷ √d_k) → mask → softmax → weighted sum (· V)
    and, for several heads: split_heads → … → merge_heads (concat) → project (· W_O)

Each stage is a plain NumPy function of already validated arrays. After computing, it calls
:func:`qkv.tracing.record` so an active :class:`~qkv.tracing.Trace` can observe the result; with no trace that
call does nothing. The reference backend is these stages applied whole; the explainer renders what they
recorded. Shape legend: B batch, H query heads, Hk key/value heads, L query length, S key length,
E query/key width per head, Ev value width per head, D model width, T any sequence length.
"""
from __future__ import annotations

import math

import numpy as np

from qkv.compute import gemm
from qkv.compute.kernels import KERNELS
from qkv.core.tracing import record

class Names:
    """The trace's step names, in one place: every stage records under these, every consumer reads them."""

    X = "X"
    X_KV = "X_kv"
    Q = "Q"
    K = "K"
    V = "V"
    Q_ROT = "Q_rot"          # Q after RoPE
    K_ROT = "K_rot"          # K after RoPE
    SCORES = "scores"        # Q·Kᵀ
    SCALED = "scaled"        # × scale (÷ √d_k)
    BIASED = "biased"        # + a positional bias (ALiBi)
    CAPPED = "capped"        # c·tanh(s / c) (logit soft-capping)
    MODIFIED = "modified"    # a custom score_mod
    MASKED = "masked"        # disallowed → −∞ (or + a float mask)
    WEIGHTS = "weights"      # softmax (with sinks: their column in the denominator)
    DROPOUT = "dropout"
    OUTPUT = "output"        # weights · V
    CONCAT = "concat"
    FINAL_OUTPUT = "final_output"


#: The attention steps in pipeline order (what the explainer and the checker walk).
PIPELINE_ORDER = (Names.Q, Names.K, Names.V, Names.Q_ROT, Names.K_ROT, Names.SCORES, Names.SCALED,
                  Names.BIASED, Names.CAPPED, Names.MODIFIED, Names.MASKED, Names.WEIGHTS, Names.OUTPUT)


#: The value a disallowed score becomes before softmax. ``-inf`` (not a magic ``-1e9``) so that a masked
#: key gets exactly zero weight; :func:`softmax` guards the rows in which every key is masked.
MASKED = -np.inf


def project(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *, name: str = "Q",
            weight_name: str = "W_Q", input_name: str = "X") -> np.ndarray:
    """Linear projection in the seeds' layout: ``x @ w (+ b)``.

    x: (..., T, D_in), w: (D_in, D_out), b: (D_out,) or None  →  (..., T, D_out)
    """
    if x.ndim > 2 and w.ndim == 2:   # one (N, D_in) x (D_in, D_out) matmul, not one per leading index
        out = gemm.matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[-1])   # (..., T, D_out)
    else:
        out = gemm.matmul(x, w)                                  # (T, D_in) x (D_in, D_out) -> (T, D_out)
    if b is not None:
        out = out + b
    bias = f" + b_{weight_name[2:]}" if b is not None else ""
    out = record(name, "matmul", f"{name} = {input_name} · {weight_name}{bias}", out,
                 operands={"a": x, "b": w, "bias": b}, params={"a_name": input_name, "b_name": weight_name})
    return out


def score(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Raw attention scores, every query against every key: ``Q · Kᵀ``.

    q: (..., L, E), k: (..., S, E)  →  (..., L, S)
    """
    s = q @ np.swapaxes(k, -1, -2)                                # (..., L, E) x (..., E, S) -> (..., L, S)
    s = record(Names.SCORES, "matmul", "scores = Q · Kᵀ", s, operands={"a": q, "b": k},
               params={"transpose_b": True, "a_name": "Q", "b_name": "K"})
    return s


def scale(scores: np.ndarray, factor: float, *, d_k: int | None = None) -> np.ndarray:
    """Scale the scores: ``scores × factor`` (the seeds' ``÷ √d_k`` when ``factor = 1/√d_k``).

    scores: (..., L, S)  →  (..., L, S)
    """
    s = scores * np.asarray(factor, dtype=scores.dtype)
    default = d_k is not None and math.isclose(factor, 1.0 / math.sqrt(d_k), rel_tol=1e-12)
    formula = "scaled = scores / √d_k" if default else "scaled = scores × scale"
    s = record(Names.SCALED, "scale", formula, s, operands={"scores": scores},
               params={"scale": float(factor), "d_k": d_k, "is_default": default})
    return s


def apply_mask(scaled: np.ndarray, mask: np.ndarray | None, *, source=None,
               input_name: str = Names.SCALED) -> np.ndarray:
    """Apply a mask before softmax.

    A boolean mask is True where attention is allowed; a disallowed score becomes ``-inf``.
    A float mask is added to the scores (0 keeps a score, ``-inf`` removes it, other values bias it).
    ``source`` says where the mask came from (a :class:`qkv.mods.MaskMod`, ``"causal"``, …), kept in the
    step's params for the explainer ("which keys each query may see, and why"); ``input_name`` names the scores
    it is given (``scaled``, or ``biased``, ``capped``, ``modified`` after a score mod), in its formula.
    scaled: (..., L, S), mask: broadcastable to (..., L, S)  →  (..., L, S)
    """
    if mask is None:
        return scaled
    if mask.dtype == np.bool_:
        out = np.where(mask, scaled, np.asarray(MASKED, dtype=scaled.dtype))
        formula = f"masked = {input_name} where mask is True, −∞ elsewhere"
    else:
        out = scaled + mask.astype(scaled.dtype, copy=False)
        formula = f"masked = {input_name} + mask"
    out = record(Names.MASKED, "mask", formula, out, operands={"scaled": scaled, "mask": mask},
                 params={"source": source, "input": input_name})
    return out


def softmax(x: np.ndarray, *, return_lse: bool = False, sinks: np.ndarray | None = None):
    """Row-wise softmax ``exp(x_j − max) / Σ exp(x − max)`` over the last axis.

    A row in which every entry is ``-inf`` (a query that may attend to nothing) becomes all zeros, not NaN.
    With ``sinks`` (learned attention sinks, gpt-oss): ``sinks`` broadcastable to (..., L, 1), one logit per
    row (per head in practice, shape (H, 1, 1)); each row's denominator gains ``exp(sink − max)``, a column
    that takes weight but contributes no value, so the row sums to less than 1.
    x: (..., L, S)  →  (..., L, S), each row summing to 1 (or to 0 for a fully masked row, < 1 with sinks).
    With ``return_lse`` also the row's log-sum-exp ``max + log Σ exp(x − max)`` (..., L) (the sink term
    included), −inf for a fully masked row without sink, from the same max and sum.
    """
    m = np.max(x, axis=-1, keepdims=True)                          # (..., L, 1) row max, for stability
    if sinks is not None:
        m = np.maximum(m, sinks)                                   # the sink column takes part in the max
    m = np.where(np.isfinite(m), m, 0.0).astype(x.dtype, copy=False)
    e = np.exp(x - m)                                              # (..., L, S) masked entries → exactly 0
    total = np.sum(e, axis=-1, keepdims=True)                      # (..., L, 1)
    operands = {"logits": x, "exp": e, "sum": total, "max": m}
    if sinks is not None:
        sink_exp = np.exp(np.asarray(sinks, x.dtype) - m)          # (..., L, 1) the sink's exp, no value
        total = total + sink_exp
        operands.update(sum=total, sinks=np.broadcast_to(sinks, m.shape), sink_exp=sink_exp)
    w = e / np.where(total == 0, 1, total)
    formula = "weights = softmax(scaled)" if sinks is None else "weights = exp(s) / (Σ exp(s) + exp(sink))"
    w = record(Names.WEIGHTS, "softmax", formula, w, operands=operands)
    if not return_lse:
        return w
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]                            # (..., L); log 0 = −inf
    return w, lse


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, style: str = "neox", name: str = Names.Q_ROT,
         positions: np.ndarray | None = None, theta: float | None = None) -> np.ndarray:
    """Rotary position embedding: rotate each pair of coordinates by its angle ``position × θ_i``.

    ``style="neox"`` pairs coordinate i with i + E/2 (Hugging Face Llama's ``rotate_half``);
    ``"interleaved"`` pairs 2i with 2i+1 (GPT-J, Meta's complex form). For a pair (a, b) at angle φ::

        a' = a·cos φ − b·sin φ,   b' = b·cos φ + a·sin φ

    x: (..., T, E), cos/sin: broadcastable to (..., T, E/2) (one angle per pair)  →  (..., T, E)
    """
    cos = cos.astype(x.dtype, copy=False)
    sin = sin.astype(x.dtype, copy=False)
    out = _rope_compiled(x, cos, sin, style)
    if out is None:
        out = _rope_numpy(x, cos, sin, style)
    src = name.split("_")[0]
    out = record(name, "rope", f"{name} = RoPE({src}, position × θ_i)", out,
                 operands={"x": x, "cos": cos, "sin": sin, "positions": positions},
                 params={"style": style, "theta": theta})
    return out


def _rope_numpy(x, cos, sin, style: str) -> np.ndarray:
    """:func:`rope`'s rotation by NumPy's passes, into a new array."""
    half = x.shape[-1] // 2
    if style == "neox":
        a, b = x[..., :half], x[..., half:]                          # (..., T, E/2) each
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    if style == "neox":
        ra, rb = out[..., :half], out[..., half:]                    # written in place: the same operations,
    else:                                                            # in the same order, as a·cos − b·sin and
        ra, rb = out[..., 0::2], out[..., 1::2]                      # b·cos + a·sin, without their temporaries
    tmp = np.empty(a.shape, x.dtype)
    np.multiply(a, cos, out=ra)
    ra -= np.multiply(b, sin, out=tmp)                                # (..., T, E/2)
    np.multiply(b, cos, out=rb)
    rb += np.multiply(a, sin, out=tmp)
    return out


def _rope_compiled(x, cos, sin, style: str):
    """:func:`rope`'s "neox" rotation in one compiled pass (:func:`qkv.compute._jit.rope_rows`, bit for bit NumPy's
    passes: each product rounded, then the sum) where the kernels are loaded and x (..., T, E) is float32,
    C-contiguous and large, with one angle row per position (cos, sin (T, E/2)): a copy of x rotated in place,
    one (T, E) matrix at a time. NumPy's six passes over the strided halves took 5.5 ms for 8 heads of
    4096 × 64 (Zen 4, `qkv bench --variants`' RoPE case). Else None."""
    T, E = x.shape[-2:]
    if style != "neox" or x.dtype != np.float32 or not x.flags.c_contiguous or sin.shape != cos.shape \
            or cos.shape[-2:] != (T, E // 2) or math.prod(cos.shape[:-2]) != 1:
        return None
    jit = KERNELS.for_block(x.dtype, x.size)
    if jit is None:
        return None
    cos, sin = (np.ascontiguousarray(c.reshape(T, E // 2)) for c in (cos, sin))
    out = x.copy()
    for m in out.reshape(-1, T, E):
        jit.rope_rows(m, 1, E, cos, sin)
    return out


def add_bias(scaled: np.ndarray, bias: np.ndarray, *, name: str = Names.BIASED,
             formula: str = "biased = scaled + m_h·(j − i)", params: dict | None = None) -> np.ndarray:
    """Add a positional bias to the scaled scores (ALiBi's ``m_h·(j − i)``). A bias is not a mask.

    scaled: (..., L, S), bias: broadcastable to (..., L, S)  →  (..., L, S)
    """
    out = scaled + bias.astype(scaled.dtype, copy=False)
    out = record(name, "bias", formula, out, operands={"scaled": scaled, "bias": np.broadcast_to(bias, out.shape)},
                 params=params or {})
    return out


def softcap(scores: np.ndarray, cap: float, *, name: str = Names.CAPPED) -> np.ndarray:
    """Logit soft-capping (Gemma 2): ``cap · tanh(scores / cap)``, every score squeezed into (−cap, cap).

    scores: (..., L, S)  →  (..., L, S)
    """
    c = np.asarray(cap, dtype=scores.dtype)
    out = c * np.tanh(scores / c)
    out = record(name, "softcap", f"{name} = c · tanh(s / c), c = {cap:g}", out, operands={"scores": scores},
                 params={"cap": float(cap)})
    return out


def dropout(weights: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """Inverted dropout on the attention weights: keep each with probability 1−p, scale kept by 1/(1−p)."""
    keep = rng.random(weights.shape) >= p                          # p = 1 keeps nothing
    factor = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    out = np.where(keep, weights * factor, 0).astype(weights.dtype, copy=False)
    out = record(Names.DROPOUT, "dropout", f"weights = dropout(weights, p={p})", out,
                 operands={"weights": weights, "keep": keep}, params={"p": p})
    return out


def weighted_sum(weights: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Each output row is the weighted sum of the value rows: ``weights · V``.

    weights: (..., L, S), v: (..., S, Ev)  →  (..., L, Ev)
    """
    out = weights @ v                                             # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    out = record(Names.OUTPUT, "matmul", "output = weights · V", out, operands={"a": weights, "b": v},
                 params={"a_name": "weights", "b_name": "V"})
    return out


def split_heads(x: np.ndarray, num_heads: int, *, name: str = "Q") -> np.ndarray:
    """Split the last axis into heads and move heads forward.

    x: (B, T, H·E)  →  (B, H, T, E)
    """
    B, T, F = x.shape
    out = x.reshape(B, T, num_heads, F // num_heads).transpose(0, 2, 1, 3)   # (B, T, H, E) -> (B, H, T, E)
    out = record(f"{name}_heads", "reshape", f"{name}_heads = {name}.view(B, T, H, d_k).transpose(1, 2)", out,
                 operands={"x": x}, params={"num_heads": num_heads})
    return out


def repeat_kv(x: np.ndarray, n_rep: int, *, name: str = "K") -> np.ndarray:
    """Grouped-query attention: share each key/value head among ``n_rep`` query heads.

    x: (..., Hk, S, E)  →  (..., Hk·n_rep, S, E), head h of the result is head h // n_rep of x
    """
    if n_rep == 1:
        return x
    out = np.repeat(x, n_rep, axis=-3)
    out = record(f"{name}_repeated", "repeat", f"{name} heads repeated ×{n_rep} (grouped-query)", out,
                 operands={"x": x}, params={"n_rep": n_rep})
    return out


def merge_heads(x: np.ndarray) -> np.ndarray:
    """Concatenate the heads back: the inverse of :func:`split_heads`.

    x: (B, H, T, E)  →  (B, T, H·E)
    """
    B, H, T, E = x.shape
    out = x.transpose(0, 2, 1, 3).reshape(B, T, H * E)          # (B, H, T, E) -> (B, T, H, E) -> (B, T, H·E)
    out = record(Names.CONCAT, "reshape", "concat = output.transpose(1, 2).view(B, T, H·d_k)", out,
                 operands={"x": x}, params={"num_heads": H})
    return out


def observe_input(name: str, array: np.ndarray, formula: str | None = None) -> np.ndarray:
    """Record an input (X, W_Q, …) so a rendering of the trace starts from it. Returns it unchanged."""
    array = record(name, "input", formula or name, array)
    return array
