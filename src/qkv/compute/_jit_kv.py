"""Attention of a few query rows over a float16 or int8 KV cache, reading the stored bytes directly: compiled by
numba (the ``jit`` extra). Imported only by :mod:`qkv.compute.kv_decode`, the first time a quantized cache is
read there.

One task per (batch row b, key/value head h), spread over numba's threads (``prange``); the task's rows are
the g query heads that share h (grouped-query attention) times the L new tokens: R = g·L rows, each with the
causal limit of its token (query l of L sees the keys 0 … S − L + l). Two passes over the cache, each of its
rows read once for all R rows::

    keys:    k̂_j = K[b, h, j] · its scales (converted once into a float32 row), s[r, j] = q_r · k̂_j
             (q already multiplied by the softmax's scale)
    softmax: per row, m = max_j s[r, j], p[r, j] = e^(s[r, j] − m) (:func:`qkv.compute._jit._expf`), l_r = Σ_j p
    values:  v̂_j = V[b, h, j] · its scales (one float32 row), acc[r] += p[r, j] · v̂_j;  out[r] = acc[r] / l_r

in float32 throughout (the scores of a task, R·S floats, stay in the cache of the core that runs it).
float16 rows arrive as their bits (uint16; numba has no float16 on the CPU): ``(bits & 0x7fff) << 13`` with
the sign bit on top, read as a float32, is the value times 2⁻¹¹², exactly, for every finite float16
(subnormals included) — one shift, one OR and one multiply, which LLVM vectorizes. (The cache stores no
non-finite float16.) int8 rows are converted as integers, times the float16 scale of their block (of 32 in
qkv's format; read the same way): one multiply per stored number, shared by the R rows' products.
"""
from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from qkv.compute._jit import _F, _OPTS, _ZERO, _expf, _maxf

__all__ = ["decode_f16", "decode_f32", "decode_int8"]

_TWO_112 = _F(2.0 ** 112)
_NEG_INF = _F(-np.inf)


@intrinsic
def _f32_of_bits(typingctx, v):
    """The float32 whose bits are the low 32 bits of the integer ``v``."""
    if not isinstance(v, types.Integer):
        return None
    sig = types.float32(v)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        x = args[0]
        width = x.type.width
        if width > 32:
            x = builder.trunc(x, i32)
        elif width < 32:
            x = builder.zext(x, i32)
        return builder.bitcast(x, ir.FloatType())
    return sig, codegen


@njit(inline="always", **_OPTS)
def _half(h):
    """The float32 value of the float16 whose bits are ``h`` (finite)."""
    u = np.uint32(h)
    return _f32_of_bits(((u & np.uint32(0x8000)) << np.uint32(16)) | ((u & np.uint32(0x7fff)) << np.uint32(13))) \
        * _TWO_112


@njit(inline="always", **_OPTS)
def _row_f16(src, scales, out, bw):
    """out (E,) float32 ← the float16 row ``src`` (E,) uint16 (its bits); ``scales`` unused."""
    for e in range(out.shape[0]):
        out[e] = _half(src[e])


@njit(inline="always", **_OPTS)
def _row_f32(src, scales, out, bw):
    """out (E,) float32 ← the float32 row ``src``; ``scales`` unused."""
    for e in range(out.shape[0]):
        out[e] = src[e]


@njit(inline="always", **_OPTS)
def _row_int8(src, scales, out, bw):
    """out (E,) float32 ← the int8 row ``src`` (E,) times its blocks' scales (⌈E/bw⌉,) (float16 bits), a block
    ``bw`` numbers."""
    E = out.shape[0]
    for blk in range(scales.shape[0]):
        d = _half(scales[blk])
        lo = blk * bw
        o, x = out[lo:min(E, lo + bw)], src[lo:min(E, lo + bw)]   # indexed by the loop's own variable
        for e in range(o.shape[0]):                          # (``lo + e`` is not known to be ≥ 0: numba's
            o[e] = _F(x[e]) * d                              # wraparound test kept the loop from vectorizing)


@njit(inline="always", **_OPTS)
def _scores(q, k, ks, b, h, g, S, s, kf, load, bw):
    """s[r, j] = q_r · k̂_j for the task's R = g·L rows (q (B, H, L, E) scaled) and keys j < S."""
    L, E = q.shape[2], q.shape[3]
    R = g * L
    qr = np.empty((R, E), np.float32)                        # the task's query rows, contiguous
    for i in range(g):
        for l in range(L):
            for e in range(E):
                qr[i * L + l, e] = q[b, h * g + i, l, e]
    for j in range(S):
        load(k[b, h, j], ks[b, h, j], kf, bw)
        for r in range(R):
            d = _ZERO
            for e in range(E):
                d += qr[r, e] * kf[e]
            s[r, j] = d


@njit(inline="always", **_OPTS)
def _softmax(s, L, S, sums):
    """Each row r of s (R, S) ← e^(s − max) over its keys j ≤ S − L + r mod L, 0 after; ``sums`` (R,) the sums."""
    for r in range(s.shape[0]):
        lim = S - L + r % L + 1
        m = _NEG_INF
        for j in range(lim):
            m = _maxf(m, s[r, j])
        acc = _ZERO
        for j in range(lim):
            p = _expf(s[r, j] - m)
            s[r, j] = p
            acc += p
        for j in range(lim, S):
            s[r, j] = _ZERO
        sums[r] = acc


@njit(inline="always", **_OPTS)
def _task(q, k, v, ks, vs, b, h, g, S, out, load, bw):
    """One (b, h) task: the attention of its R = g·L query rows over the keys and values 0 … S−1 into out."""
    L, E, Ev = q.shape[2], q.shape[3], v.shape[3]
    R = g * L
    s = np.empty((R, S), np.float32)
    kf = np.empty(E, np.float32)
    _scores(q, k, ks, b, h, g, S, s, kf, load, bw)
    sums = np.empty(R, np.float32)
    _softmax(s, L, S, sums)
    acc = np.zeros((R, Ev), np.float32)
    vf = np.empty(Ev, np.float32)
    for j in range(S):
        load(v[b, h, j], vs[b, h, j], vf, bw)
        for r in range(R):
            p = s[r, j]
            for e in range(Ev):
                acc[r, e] += p * vf[e]
    for r in range(R):
        inv = _F(1.0) / sums[r]
        i, l = r // L, r % L
        for e in range(Ev):
            out[b, h * g + i, l, e] = acc[r, e] * inv


@njit(parallel=True, **_OPTS)
def decode_int8(q, k, v, ks, vs, S, out, bw):
    """out (B, H, L, Ev) ← the attention of q (B, H, L, E) float32 (times the softmax's scale) over the int8
    keys k (B, Hk, C, E) and values v (B, Hk, C, Ev) with their blocks' scales ks (B, Hk, C, ⌈E/bw⌉) and vs
    (B, Hk, C, ⌈Ev/bw⌉) (float16 bits, uint16; ``bw`` numbers a block), keys 0 … S−1 (C ≥ S), causal bottom-right (the L queries
    are the last L of the S keys); H = g·Hk."""
    B, Hk = k.shape[0], k.shape[1]
    g = q.shape[1] // Hk
    for t in prange(B * Hk):
        _task(q, k, v, ks, vs, t // Hk, t % Hk, g, S, out, _row_int8, bw)


@njit(parallel=True, **_OPTS)
def decode_f16(q, k, v, ks, vs, S, out, bw):
    """:func:`decode_int8` over float16 keys and values, given as their bits (uint16 views); ``ks``, ``vs``
    any float32 arrays of k's first three dimensions and ``bw`` any int (unused: scale 1)."""
    B, Hk = k.shape[0], k.shape[1]
    g = q.shape[1] // Hk
    for t in prange(B * Hk):
        _task(q, k, v, ks, vs, t // Hk, t % Hk, g, S, out, _row_f16, bw)


@njit(parallel=True, **_OPTS)
def decode_f32(q, k, v, ks, vs, S, out, bw):
    """:func:`decode_f16` over float32 keys and values (a reference for the timings: the same loop, four bytes
    a number)."""
    B, Hk = k.shape[0], k.shape[1]
    g = q.shape[1] // Hk
    for t in prange(B * Hk):
        _task(q, k, v, ks, vs, t // Hk, t % Hk, g, S, out, _row_f32, bw)
