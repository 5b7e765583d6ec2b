"""Q4_1 products with 8-bit activations, as llama.cpp computes them: ``load_llama(activations="int8")``.

The activations x (one row, width k) are quantized once per product in blocks of 32 — ``d_x = max|x| / 127``,
``q_x = round(x / d_x)`` int8 and ``s_x = d_x · Σ q_x`` (llama.cpp's Q8_1) — and each Q4_1 block of a weight row
(``w = d·q + m``, q the 4-bit values) gives ``d·d_x · Σ q·q_x + m·s_x``: the integer dot product of 32 bytes in
one AVX-512 VNNI instruction (``vpdpbusd``: unsigned × signed bytes into 32-bit sums), where the float32 path
(:mod:`qkv.models._quant_jit`) dequantizes every weight and multiplies in float32. About a quarter of the work, at
the cost of rounding the activations to 8 bits (what llama.cpp does): a product's relative error against the
float32 one is about 0.5 %. Without VNNI (``avx512vnni`` and ``avx512vl`` in LLVM's host features) the same
integer arithmetic runs as plain loops.
"""
from __future__ import annotations

from types import MappingProxyType

import llvmlite.binding as _llvm
import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from qkv.models._quant_jit import _I8, _I16, _I32, _F32, _ptr, _scale, _splat

__all__ = ["VNNI", "matvec_q4_1_q8", "quantize_q8"]

_FEATURES = _llvm.get_host_cpu_features()
#: Whether the byte dot products run as AVX-512 VNNI instructions (else plain loops, the same sums).
VNNI = bool(_FEATURES.get("avx512vnni", False) and _FEATURES.get("avx512vl", False))
_V8I, _V8F = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
_OPTS = MappingProxyType(dict(nogil=True, cache=True, error_model="numpy", boundscheck=False))


@intrinsic
def _dot_vnni(typingctx, row, nb, xq, xd, xs):
    """Σ over the ``nb`` Q4_1 blocks of ``row`` (uint8, 20 bytes a block) of ``d·xd[b]·Σ q·xq + m·xs[b]``."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        zero64 = ir.Constant(i64, 0)
        row_p, xq_p = (_ptr(context, builder, sig.args[i], args[i], zero64, _I8) for i in (0, 2))
        xd_p, xs_p = (_ptr(context, builder, sig.args[i], args[i], zero64, _F32) for i in (3, 4))
        vnni = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8I, [_V8I] * 3),
                                              "llvm.x86.avx512.vpdpbusd.256")
        n, entry = args[1], builder.block
        loop, done = builder.append_basic_block("q8.loop"), builder.append_basic_block("q8.done")
        zf = ir.Constant(_V8F, [0.0] * 8)
        builder.cbranch(builder.icmp_signed(">", n, zero64), loop, done)
        builder.position_at_end(loop)
        b, acc, macc = builder.phi(i64), builder.phi(_V8F), builder.phi(_F32)
        base = builder.gep(row_p, [builder.mul(b, ir.Constant(i64, 20))])

        def half(off):
            h = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(i64, off)]), _I16.as_pointer()), align=1)
            return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)
        d, m = half(0), half(2)
        v16 = ir.VectorType(_I8, 16)
        q = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(i64, 4)]), v16.as_pointer()), align=1)
        lo, hi = builder.and_(q, ir.Constant(v16, [15] * 16)), builder.lshr(q, ir.Constant(v16, [4] * 16))
        w = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        x = builder.load(builder.bitcast(builder.gep(xq_p, [builder.mul(b, ir.Constant(i64, 32))]),
                                         ir.VectorType(_I8, 32).as_pointer()), align=1)
        dot = builder.call(vnni, [ir.Constant(_V8I, [0] * 8), builder.bitcast(w, _V8I), builder.bitcast(x, _V8I)])
        scale = _splat(builder, builder.fmul(d, builder.load(builder.gep(xd_p, [b]))), 8)
        acc2 = builder.fadd(acc, builder.fmul(builder.sitofp(dot, _V8F), scale, flags=("contract",)),
                            flags=("contract",))
        macc2 = builder.fadd(macc, builder.fmul(m, builder.load(builder.gep(xs_p, [b]))))
        nxt, end = builder.add(b, ir.Constant(i64, 1)), builder.block
        for phi, first, later in ((b, zero64, nxt), (acc, zf, acc2), (macc, ir.Constant(_F32, 0.0), macc2)):
            phi.add_incoming(first, entry)
            phi.add_incoming(later, end)
        builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
        builder.position_at_end(done)
        ta, tm = builder.phi(_V8F), builder.phi(_F32)
        for phi, first, later in ((ta, zf, acc2), (tm, ir.Constant(_F32, 0.0), macc2)):
            phi.add_incoming(first, entry)
            phi.add_incoming(later, end)
        v = ta
        for width in (4, 2, 1):                                      # lanes added in halves: 8 → 1
            lo_, hi_ = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width), list(range(a, a + width))))
                        for a in (0, width))
            v = builder.fadd(lo_, hi_)
        return builder.fadd(builder.extract_element(v, ir.Constant(_I32, 0)), tm)
    return types.float32(row, nb, xq, xd, xs), codegen


@njit(**_OPTS)
def _dot_loops(row, nb, xq, xd, xs):
    """:func:`_dot_vnni`'s sums as plain loops (no VNNI)."""
    total = np.float32(0.0)
    for b in range(nb):
        p = 20 * b
        d, m = _scale(row, p), _scale(row, p + 2)
        s = 0
        for j in range(16):
            v = row[p + 4 + j]
            s += np.int32(v & 15) * np.int32(xq[32 * b + j]) + np.int32(v >> 4) * np.int32(xq[32 * b + 16 + j])
        total += d * xd[b] * np.float32(s) + m * xs[b]
    return total


@njit(**_OPTS)
def quantize_q8(x, xq, xd, xs):
    """x (k,) float32 → xq (k,) int8, xd and xs (k / 32,) float32: per block of 32, ``d = max|x| / 127``,
    ``q = round(x / d)``, ``s = d·Σ q`` (llama.cpp's Q8_1; a block of zeros gets d = 0)."""
    for b in range(x.shape[0] // 32):
        a = np.float32(0.0)
        for j in range(32):
            a = max(a, abs(x[32 * b + j]))
        d = a / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        s = 0
        for j in range(32):
            q = np.int32(np.rint(x[32 * b + j] * inv))
            xq[32 * b + j] = q
            s += q
        xd[b], xs[b] = d, d * np.float32(s)


def _build(dot):
    @njit(parallel=True, **_OPTS)
    def matvec(data, x, out, chunks):
        """``out[0] = x[0] @ W.T`` for a Q4_1 matrix ``data`` (out, k / 32 · 20) and one row x (1, k), x quantized
        to 8 bits per block of 32; the output rows in ``chunks`` ranges on numba's threads."""
        k = x.shape[1]
        nb = k // 32
        xq, xd, xs = np.empty(k, np.int8), np.empty(nb, np.float32), np.empty(nb, np.float32)
        quantize_q8(x[0], xq, xd, xs)
        n = data.shape[0]
        for c in prange(chunks):
            for r in range(c * n // chunks, (c + 1) * n // chunks):
                out[0, r] = dot(data[r], nb, xq, xd, xs)
    return matvec


matvec_q4_1_q8 = _build(_dot_vnni if VNNI else _dot_loops)
