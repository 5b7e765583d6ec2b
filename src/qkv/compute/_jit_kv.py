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
float16 rows arrive as their bits (uint16; numba has no float16 on the CPU) and are converted by LLVM's
``fpext`` (:func:`_f16_value`: exact, subnormals included; one ``vcvtph2ps`` per 16 numbers with F16C). An
earlier bit trick through float32 subnormals was flushed to zero in one function compiled on its own, and was
slower (30 layers × 4,096 positions of SmolLM2's shapes: 8.3–9.0 ms against 6.7–7.5 ms). int8 rows are
converted as integers, times the float16 scale of their block (of 32 in qkv's format; read the same way): one
multiply per stored number, shared by the R rows' products.
"""
from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from qkv.compute._jit import _F, _OPTS, _ZERO, _expf, _maxf

__all__ = ["decode_f16", "decode_f32", "decode_int8", "store_f16", "store_f32", "store_int8"]

_NEG_INF = _F(-np.inf)
_F16_MAX = _F(65504.0)
#: Scores further than this below their row's maximum get weight 0, not e^x: each such weight is below
#: e^−64 = 1.6e−28 of the maximum's (1), so no float32 sum of them reaches an ulp of the row's sum (≥ 1), while
#: the products p · v of weights near float32's smallest normal (e^−87) are subnormal numbers, which cost the
#: CPU about a hundred times a normal multiply-add: a trained model's peaked rows made a step at 4,096
#: positions 3× slower than random scores did.
_TINY = _F(-64.0)
_Q_MAX = _F(127.0)


@njit(inline="always", **_OPTS)
def _row_f16(src, scales, out, bw):
    """out (E,) float32 ← the float16 row ``src`` (E,) uint16 (its bits); ``scales`` unused."""
    for e in range(out.shape[0]):
        out[e] = _f16_value(src[e])


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
        d = _f16_value(scales[blk])
        lo = blk * bw
        o, x = out[lo:min(E, lo + bw)], src[lo:min(E, lo + bw)]   # indexed by the loop's own variable
        for e in range(o.shape[0]):                          # (``lo + e`` is not known to be ≥ 0: numba's
            o[e] = _F(x[e]) * d                              # wraparound test kept the loop from vectorizing)


@intrinsic
def _f16_bits(typingctx, v):
    """The bits (uint16) of the float16 nearest to the float32 ``v`` (ties to even: LLVM's ``fptrunc``)."""
    if v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(v), codegen


@intrinsic
def _prefetch(typingctx, arr, i, j, n):
    """Ask for the cache line of ``arr[i, j, n]`` (a 4-d array: a row ``n`` of a cache), for reading."""
    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        idx = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:4], signature.args[1:4])]
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], a, idx + [context.get_constant(
            types.intp, 0)], wraparound=False)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]
                                                                            + [ir.IntType(32)] * 3), "llvm.prefetch")
        builder.call(fn, [builder.bitcast(ptr, ir.IntType(8).as_pointer()), ir.Constant(ir.IntType(32), 0),
                          ir.Constant(ir.IntType(32), 3), ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()
    return types.void(arr, i, j, n), codegen


#: Rows ahead of the one being read that the kernels ask the memory for (4 KiB of float16 rows of 64). A layer's
#: cache is read once a step, from DRAM at long contexts: 30 layers × 4,096 positions of SmolLM2's shapes took
#: 9.8 ms a step in float16 without the hint, 7.4 ms with it, 6.7 ms with every row in the CPU's caches (float32:
#: 14.1 and 13.5 ms; the Intel Xeon of RESULTS.md, 2 threads).
AHEAD = 32


@intrinsic
def _f16_value(typingctx, h):
    """The float32 value of the float16 whose bits are the low 16 bits of the integer ``h`` (LLVM's ``fpext``:
    exact, subnormals included)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        x, i16 = args[0], ir.IntType(16)
        x = builder.trunc(x, i16) if x.type.width > 16 else builder.zext(x, i16) if x.type.width < 16 else x
        return builder.fpext(builder.bitcast(x, ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen


# ---------------------------------------------------------------------------------------------- stores
# A decoding step's new key or value row (E,) float32 into a cache row as :mod:`qkv.core.kv_quant` stores it,
# bit for bit; False (nothing to rely on in the row) where it holds a number the format cannot store.
@njit(inline="always", **_OPTS)
def store_f32(src, dst, scales, bw):
    """dst (E,) float32 ← src; ``scales``, ``bw`` unused."""
    for e in range(src.shape[0]):
        dst[e] = src[e]
    return True


@njit(inline="always", **_OPTS)
def store_f16(src, dst, scales, bw):
    """dst (E,) uint16 ← the float16 bits of src (nearest, ties to even); False where |x| > 65504 or NaN."""
    for e in range(src.shape[0]):
        x = src[e]
        if not abs(x) <= _F16_MAX:
            return False
        dst[e] = _f16_bits(x)
    return True


@njit(inline="always", **_OPTS)
def store_int8(src, dst, scales, bw):
    """dst (E,) int8 and scales (⌈E/bw⌉,) uint16 (float16 bits) ← src in blocks of bw: d = max|x| / 127 rounded
    up to a float16, q = round(x / d) clipped to ±127 (0 where d = 0); False where a block is not finite or
    its d exceeds 65504."""
    E = src.shape[0]
    for blk in range(scales.shape[0]):
        lo, hi = blk * bw, min(E, blk * bw + bw)
        a = _ZERO
        for e in range(lo, hi):
            x = src[e]
            if x != x:
                return False
            a = max(a, abs(x))
        d = a / _Q_MAX
        if not d <= _F16_MAX:
            return False
        h = _f16_bits(d)
        if _f16_value(h) < d:                                # rounded down: one float16 step up
            h = np.uint16(h + np.uint16(1))
        df = _f16_value(h)
        scales[blk] = h
        for e in range(lo, hi):
            q = np.rint(src[e] / df) if df > _ZERO else _ZERO
            dst[e] = np.int8(min(_Q_MAX, max(-_Q_MAX, q)))
    return True


@njit(inline="always", **_OPTS)
def _scores(q, k, ks, b, h, g, j0, j1, s, kf, load, bw):
    """s[r, j − j0] = q_r · k̂_j for the task's R = g·L rows (q (B, H, L, E) scaled) and keys j0 … j1 − 1."""
    L, E = q.shape[2], q.shape[3]
    R = g * L
    qr = np.empty((R, E), np.float32)                        # the task's query rows, contiguous
    for i in range(g):
        for l in range(L):
            for e in range(E):
                qr[i * L + l, e] = q[b, h * g + i, l, e]
    for j in range(j0, j1):
        _prefetch(k, b, h, min(j + AHEAD, j1 - 1))
        load(k[b, h, j], ks[b, h, j], kf, bw)
        for r in range(R):
            d = _ZERO
            for e in range(E):
                d += qr[r, e] * kf[e]
            s[r, j - j0] = d


@njit(inline="always", **_OPTS)
def _softmax(s, L, S, j0, mx, sums):
    """Each row r of s (R, n), keys j0 … j0 + n − 1, ← e^(s − m) over its keys j ≤ S − L + r mod L, 0 after;
    ``mx`` (R,) the maxima m (−inf for a row that sees none of these keys), ``sums`` (R,) the sums."""
    n = s.shape[1]
    for r in range(s.shape[0]):
        lim = min(n, max(0, S - L + r % L + 1 - j0))
        m = _NEG_INF
        for j in range(lim):
            m = _maxf(m, s[r, j])
        acc = _ZERO
        for j in range(lim):
            x = s[r, j] - m
            p = _expf(x) if x > _TINY else _ZERO             # below e^−64: 0 (no subnormals downstream)
            s[r, j] = p
            acc += p
        for j in range(lim, n):
            s[r, j] = _ZERO
        mx[r], sums[r] = m, acc


@njit(inline="always", **_OPTS)
def _part(q, k, v, ks, vs, b, h, g, S, j0, j1, mx, sums, acc, load, bw):
    """One task: the (b, h) rows' attention over the keys and values j0 … j1 − 1 alone, unnormalised:
    acc (R, Ev) = Σ_j e^(s_j − m) · v̂_j, with the rows' maxima m in ``mx`` and Σ_j e^(s_j − m) in ``sums``."""
    E, Ev = q.shape[3], v.shape[3]
    R = acc.shape[0]
    s = np.empty((R, j1 - j0), np.float32)
    kf = np.empty(E, np.float32)
    _scores(q, k, ks, b, h, g, j0, j1, s, kf, load, bw)
    _softmax(s, q.shape[2], S, j0, mx, sums)
    acc[...] = _ZERO
    vf = np.empty(Ev, np.float32)
    for j in range(j0, j1):
        _prefetch(v, b, h, min(j + AHEAD, j1 - 1))
        load(v[b, h, j], vs[b, h, j], vf, bw)
        for r in range(R):
            p = s[r, j - j0]
            for e in range(Ev):
                acc[r, e] += p * vf[e]


@njit(inline="always", **_OPTS)
def _merge(mx, sums, acc, b, h, g, L, out):
    """out[b, h·g + i, l] ← the parts' (mx, sums, acc) (P, R, ·) of one (b, h) merged by their maxima:
    Σ_p acc_p · e^(m_p − M) / Σ_p l_p · e^(m_p − M), M the largest (one part: acc / l)."""
    P, R, Ev = acc.shape
    for r in range(R):
        top = mx[0, r]
        for c in range(1, P):
            top = _maxf(top, mx[c, r])
        total = _ZERO
        o = np.zeros(Ev, np.float32)
        for c in range(P):
            w = _expf(mx[c, r] - top)
            total += sums[c, r] * w
            for e in range(Ev):
                o[e] += acc[c, r, e] * w
        inv = _F(1.0) / total
        for e in range(Ev):
            out[b, h * g + r // L, r % L, e] = o[e] * inv


@njit(inline="always", **_OPTS)
def _split(q, k, v, ks, vs, S, out, bw, parts, load):
    """The tasks: every (batch row b, key/value head h) in ``parts`` runs of the S keys (flash-decoding: a few
    heads still fill every thread), then each (b, h)'s runs merged (:func:`_merge`)."""
    B, Hk = k.shape[0], k.shape[1]
    L, Ev = q.shape[2], v.shape[3]
    g = q.shape[1] // Hk
    R = g * L
    P = max(1, min(parts, S))
    mx = np.empty((B * Hk, P, R), np.float32)
    sums = np.empty((B * Hk, P, R), np.float32)
    acc = np.empty((B * Hk, P, R, Ev), np.float32)
    for t in prange(B * Hk * P):
        bh, c = t // P, t % P
        _part(q, k, v, ks, vs, bh // Hk, bh % Hk, g, S, c * S // P, (c + 1) * S // P, mx[bh, c], sums[bh, c],
              acc[bh, c], load, bw)
    for bh in range(B * Hk):
        _merge(mx[bh], sums[bh], acc[bh], bh // Hk, bh % Hk, g, L, out)


@njit(parallel=True, **_OPTS)
def decode_int8(q, k, v, ks, vs, S, out, bw, parts=1):
    """out (B, H, L, Ev) ← the attention of q (B, H, L, E) float32 (times the softmax's scale) over the int8
    keys k (B, Hk, C, E) and values v (B, Hk, C, Ev) with their blocks' scales ks (B, Hk, C, ⌈E/bw⌉) and vs
    (B, Hk, C, ⌈Ev/bw⌉) (float16 bits, uint16; ``bw`` numbers a block), keys 0 … S−1 (C ≥ S), causal
    bottom-right (the L queries are the last L of the S keys); H = g·Hk. ``parts``: runs of keys per
    (b, h), each a task (:func:`_split`)."""
    _split(q, k, v, ks, vs, S, out, bw, parts, _row_int8)


@njit(parallel=True, **_OPTS)
def decode_f16(q, k, v, ks, vs, S, out, bw, parts=1):
    """:func:`decode_int8` over float16 keys and values, given as their bits (uint16 views); ``ks``, ``vs``
    any float32 arrays of k's first three dimensions and ``bw`` any int (unused: scale 1)."""
    _split(q, k, v, ks, vs, S, out, bw, parts, _row_f16)


@njit(parallel=True, **_OPTS)
def decode_f32(q, k, v, ks, vs, S, out, bw, parts=1):
    """:func:`decode_f16` over float32 keys and values (the decoding step's float32 cache)."""
    _split(q, k, v, ks, vs, S, out, bw, parts, _row_f32)
