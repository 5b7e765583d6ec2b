"""The Llama decoder's row-wise arithmetic (:mod:`qkv.models.llama`): RMSNorm, SiLU, SwiGLU and RoPE in place,
the heads' rows side by side, and the work arrays kept per thread."""
from __future__ import annotations

import math
import threading

import numpy as np

from qkv import _checks
from qkv.compute.kernels import KERNELS


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis: ``x · (1 / √(mean(x²) + eps)) · weight`` (Llama's, as transformers writes
    it: ``x * rsqrt(variance + eps) * weight``; float32 in, float32 out). ``out``: where to write it.

    Rows (n, D) of float32 in one compiled pass where the engine's kernels are loaded and the rows are many
    (:func:`qkv.compute._jit.rms_norm_rows`: ``1 / √(mean(x²) + eps)`` in float64); else NumPy's passes."""
    jit = _kernels_for(x) if x.ndim == 2 and weight.dtype == x.dtype else None
    if jit is not None and (out is None or (out.shape == x.shape and out.dtype == x.dtype)):
        out = np.empty_like(x) if out is None else out
        jit.rms_norm_rows(x, weight, float(eps), out)
        return out
    ms = np.einsum("...d,...d->...", x, x)[..., None]             # Σ x², (..., 1)
    ms *= x.dtype.type(1.0 / x.shape[-1])
    ms += x.dtype.type(eps)
    np.sqrt(ms, out=ms)
    np.divide(1, ms, out=ms)                                       # 1 / rms, (..., 1)
    out = np.multiply(x, ms, out=out)
    out *= weight
    return out


def silu_(h: np.ndarray) -> np.ndarray:
    """SiLU in place, ``h · sigmoid(h) = h / (1 + e^(−h))``."""
    with np.errstate(over="ignore"):                               # e^(−h) = inf for h < −88: h / inf = −0
        e = np.exp(-h)
    e += 1
    h /= e
    return h


def swiglu_(gate_up: np.ndarray, e: np.ndarray | None = None) -> np.ndarray:
    """``silu(g) ⊙ u`` from ``gate_up`` = [g | u] (N, 2F), written over g, which it returns (N, F), as
    ``(g ⊙ u) / (1 + e^(−g))``: four passes over (N, F), no temporary when ``e`` (N, F) is given — or one, by
    the engine's compiled kernels (:mod:`qkv.kernels`) where they are loaded and the block is large."""
    F = gate_up.shape[-1] // 2
    g, u = gate_up[..., :F], gate_up[..., F:]
    jit = KERNELS.for_block(gate_up.dtype, g.size) if gate_up.ndim == 2 and gate_up.flags.c_contiguous else None
    if jit is not None:                                            # one compiled pass (qkv.kernels)
        jit.swiglu_rows(gate_up, F)
        return g
    e = np.negative(g, out=e)
    with np.errstate(over="ignore"):                               # e^(−g) = inf for g < −88: g·u / inf = ±0
        np.exp(e, out=e)
    e += 1
    g *= u
    g /= e
    return g


def rope_neox_(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """RoPE ("neox" pairs i, i + E/2) in place on x (..., E) float32, cos/sin broadcastable to (..., E/2):
    ``a' = a·cos − b·sin``, ``b' = b·cos + a·sin`` — the same operations, in the same order, as
    :func:`qkv.stages.rope` (bit for bit equal), without its four temporaries. ``tmp``: (2, …, E/2) scratch."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]                            # (..., E/2) each, views of x
    if tmp is None:
        tmp = np.empty((2,) + a.shape, x.dtype)
    bs = np.multiply(b, sin, out=tmp[0])                           # b·sin
    as_ = np.multiply(a, sin, out=tmp[1])                          # a·sin
    a *= cos
    a -= bs
    b *= cos
    b += as_
    return x


def rope_rows_(x: np.ndarray, heads: int, cos: np.ndarray, sin: np.ndarray, e: int,
               tmp: np.ndarray | None = None) -> np.ndarray:
    """:func:`rope_neox_` in place on the first ``heads`` heads of e numbers at the start of each row of x
    (n, W) (a model's [Q | K | V] rows: Q and K rotated together), cos, sin (n, e/2) — bit for bit, in one
    compiled pass where the kernels are loaded and the rows are many (:func:`qkv.compute._jit.rope_rows`)."""
    n = x.shape[0]
    jit = _kernels_for(x)
    if jit is not None and x.flags.c_contiguous:
        jit.rope_rows(x, heads, e, cos, sin)
    else:
        rope_neox_(_view(x[:, :heads * e], (n, heads, e)), cos[:, None], sin[:, None], tmp)
    return x


def col_extents(x: np.ndarray, edges: tuple) -> tuple:
    """max |x[:, a:b]| of x (n, W) for each range ``a, b`` of consecutive ``edges``, None where one is not
    finite (:func:`qkv._checks.finite_max_abs`) — in one compiled pass where the kernels are loaded and the
    rows are many (:func:`qkv.compute._jit.col_extents`)."""
    jit = _kernels_for(x)
    if jit is None or not x.flags.c_contiguous:
        return tuple(_checks.finite_max_abs(x[:, a:b]) for a, b in zip(edges[:-1], edges[1:]))
    got = np.empty(len(edges) - 1)
    jit.col_extents(x, np.asarray(edges, np.int64), got)
    return tuple(float(m) if math.isfinite(m) else None for m in got)


def _kernels_for(x: np.ndarray):
    """The engine's compiled kernels (:mod:`qkv.compute._jit`) for float32 rows x (n, ·) with contiguous columns, where
    loaded and x is large enough to pay for them (:meth:`qkv.kernels.Kernels.for_block`); else None."""
    if x.ndim != 2 or x.strides[1] != x.itemsize:
        return None
    return KERNELS.for_block(x.dtype, x.size)


def _view(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` reshaped without a copy (an error, not a silent copy, if its strides do not allow it)."""
    v = a.view()
    v.shape = shape
    return v


def _heads_to_rows(o: np.ndarray, rows: slice, out: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of the flattened (B·L) tokens of o (B, H, L, E), heads side by side: out (len(rows), H·E)."""
    _between(o, rows, out, into_heads=False)
    return out


def _rows_to_heads(src: np.ndarray, rows: slice, dst: np.ndarray) -> None:
    """:func:`_heads_to_rows` the other way: src (len(rows), H·E), heads side by side, into dst (B, H, L, E) at
    rows ``rows`` of its flattened (B·L) tokens."""
    _between(dst, rows, src, into_heads=True)


def _between(heads: np.ndarray, rows: slice, flat: np.ndarray, into_heads: bool) -> None:
    """Copy between rows ``rows`` of heads (B, H, L, E)'s flattened tokens and flat (len(rows), H·E), one piece
    per text the rows touch."""
    B, H, L, E = heads.shape
    flat3 = _view(flat, (flat.shape[0], H, E))
    i = rows.start
    while i < rows.stop:
        b, t = divmod(i, L)
        j = min(rows.stop, (b + 1) * L)
        h, f = heads[b, :, t:t + j - i], flat3[i - rows.start:j - rows.start].transpose(1, 0, 2)
        if into_heads:
            np.copyto(h, f)
        else:
            np.copyto(f, h)
        i = j


class _Scratch(threading.local):
    """Work arrays kept per thread (the caller's and each runtime worker's) and reused from call to call:
    a fresh multi-megabyte NumPy array costs its page faults every time (measured 0.75 ms for a product of
    two (256, 1536) float32 arrays into a new array, 0.18 ms into an existing one)."""

    def __init__(self):
        self.arrays: dict = {}

    def get(self, name: str, shape: tuple, dtype=np.float32) -> np.ndarray:
        size = math.prod(shape)
        a = self.arrays.get(name)
        if a is None or a.size < size or a.dtype != dtype:
            a = self.arrays[name] = np.empty(size, dtype)
        return _view(a[:size], shape)
