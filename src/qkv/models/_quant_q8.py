"""Products with 8-bit activations, as llama.cpp computes them: ``load_llama(activations="int8")``.

The activations x (a row, width k) are quantized once per product in blocks of 32, with llama.cpp's rules
(``quantize_row_q8_1`` / ``_q8_0``, x86): ``a = max|x|``, ``q_x = round(x · 127 / a)`` (to nearest even), the
scale ``d_x = a / 127`` and, for Q4_1, ``s_x = d_x · Σ q_x``, both stored as float16 (:func:`round_f16`). Then

* a Q4_1 block of a weight row (``w = d·q + m``, q the 4-bit values) gives ``d·d_x · Σ q·q_x + m·s_x``;
* a Q8_0 block (``w = d·q``, q int8) gives ``d·d_x · Σ q·q_x``;

the integer dot product of 32 bytes in one AVX-512 VNNI instruction (``vpdpbusd``: unsigned × signed bytes
into 32-bit sums; Q8_0's signed weights by the sign trick, ``|q|`` × ``sign(q)·q_x``), eight lanes of float32
sums added in halves at the end, where the float32 path (:mod:`qkv.models._quant_jit`) dequantizes every weight
and multiplies in float32. About a quarter of the work, at the cost of rounding the activations to 8 bits (what
llama.cpp does): a product's relative error against the float32 one is about 0.5 %. Without VNNI
(``avx512vnni`` and ``avx512vl`` in LLVM's host features) the same integer arithmetic runs as plain loops.

More rows than the kernels take (a prompt) are rounded the same way (:func:`round_rows`) and multiplied by
the float32 path: the same values, summed in another order.
"""
from __future__ import annotations

import math
from types import MappingProxyType

import llvmlite.binding as _llvm
import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from qkv.models._quant_jit import _I8, _I16, _I32, _F32, _ptr, _scale, _splat, prefetch_ahead

__all__ = ["KINDS", "VNNI", "matvec_q4_1_q8", "matvec_q8", "matvec_q8_0_q8", "quantize_q8", "round_f16",
           "round_rows"]

_FEATURES = _llvm.get_host_cpu_features()
#: Whether the byte dot products run as AVX-512 VNNI instructions (else plain loops, the same sums).
VNNI = bool(_FEATURES.get("avx512vnni", False) and _FEATURES.get("avx512vl", False))
#: the kernel kind codes (:data:`qkv.models._quant.TYPES`) of the types multiplied here: Q4_1, Q8_0
KINDS = (2, 3)
_V8I, _V8F = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
_OPTS = MappingProxyType(dict(nogil=True, cache=True, error_model="numpy", boundscheck=False))


@njit(**_OPTS)
def round_f16(v):
    """The float16 nearest to float32 ``v`` (ties to even; subnormals and overflow to inf as IEEE), as float32:
    what llama.cpp stores its activations' scales as (``GGML_FP32_TO_FP16``)."""
    a = abs(np.float64(v))
    if a == 0.0 or a != a:
        return v
    if a >= 65520.0:
        return np.float32(math.copysign(math.inf, v))
    e = math.frexp(a)[1] - 1                      # a = 1.f · 2^e
    quantum = math.ldexp(1.0, max(e, -14) - 10)   # 11 significant bits; below 2^-14 the subnormals' 2^-24
    return np.float32(math.copysign(np.rint(a / quantum) * quantum, v))


@njit(**_OPTS)
def quantize_q8(x, xq, xd, xs):
    """x (k,) float32 → xq (k,) int8, xd and xs (k / 32,) float32, per block of 32 as llama.cpp's x86
    ``quantize_row_q8_1``: ``a = max|x|``, ``q = round(x · (127 / a))`` (ties to even), ``d = a / 127``;
    ``xd = f16(d)``, ``xs = f16(d · Σ q)`` (:func:`round_f16`; a block of zeros gets 0)."""
    for b in range(x.shape[0] // 32):
        a = np.float32(0.0)
        for j in range(32):
            a = max(a, abs(x[32 * b + j]))
        d = a / np.float32(127.0)
        inv = np.float32(127.0) / a if a != 0 else np.float32(0.0)
        s = 0
        for j in range(32):
            q = np.int32(np.rint(x[32 * b + j] * inv))
            xq[32 * b + j] = q
            s += q
        xd[b], xs[b] = round_f16(d), round_f16(d * np.float32(s))


@njit(parallel=True, **_OPTS)
def round_rows(x, out):
    """out (n, k) = x (n, k) float32 rounded as :func:`quantize_q8` rounds each row: ``xd · xq`` per block."""
    n, k = x.shape
    for r in prange(n):
        xq, xd, xs = np.empty(k, np.int8), np.empty(k // 32, np.float32), np.empty(k // 32, np.float32)
        quantize_q8(x[r], xq, xd, xs)
        for j in range(k):
            out[r, j] = xd[j // 32] * np.float32(xq[j])
    return out


def _hsum8(builder, v):
    """The 8 lanes of v added in halves (8 → 4 → 2 → 1), as llama.cpp's ``hsum_float_8``."""
    for width in (4, 2, 1):
        lo, hi = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width), list(range(a, a + width))))
                  for a in (0, width))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _q4_1_block(builder, base, x):
    """A Q4_1 block at ``base``: (its 32 weights as unsigned bytes, x as signed bytes, d, m)."""
    v16 = ir.VectorType(_I8, 16)
    q = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), 4)]), v16.as_pointer()), align=1)
    lo, hi = builder.and_(q, ir.Constant(v16, [15] * 16)), builder.lshr(q, ir.Constant(v16, [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32)))), x, _half(builder, base, 0), _half(builder, base, 2)


def _q8_0_block(builder, base, x):
    """A Q8_0 block at ``base``: (|q| as unsigned bytes, sign(q)·x as signed bytes, d, None): the sign trick."""
    v32 = ir.VectorType(_I8, 32)
    q = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), 2)]), v32.as_pointer()), align=1)
    neg, zero = builder.icmp_signed("<", q, ir.Constant(v32, [0] * 32)), ir.Constant(v32, [0] * 32)
    return (builder.select(neg, builder.sub(zero, q), q), builder.select(neg, builder.sub(zero, x), x),
            _half(builder, base, 0), None)


def _half(builder, base, off):
    h = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), off)]), _I16.as_pointer()),
                     align=1)
    return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)


def _vnni_dot(block, nbytes):
    """An intrinsic: Σ over the ``nb`` blocks (``nbytes`` each) of ``row`` (uint8) of ``d·xd[b]·Σ q·xq``
    (+ ``m·xs[b]`` where ``block`` gives an m), the integer sums on VNNI."""
    def dot(typingctx, row, nb, xq, xd, xs):
        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            zero64, fzero = ir.Constant(i64, 0), ir.Constant(_F32, 0.0)
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
            x = builder.load(builder.bitcast(builder.gep(xq_p, [builder.mul(b, ir.Constant(i64, 32))]),
                                             ir.VectorType(_I8, 32).as_pointer()), align=1)
            base = builder.gep(row_p, [builder.mul(b, ir.Constant(i64, nbytes))])
            prefetch_ahead(builder, base)
            u, s, d, m = block(builder, base, x)
            dot = builder.call(vnni, [ir.Constant(_V8I, [0] * 8), builder.bitcast(u, _V8I), builder.bitcast(s, _V8I)])
            scale = _splat(builder, builder.fmul(d, builder.load(builder.gep(xd_p, [b]))), 8)
            acc2 = builder.fadd(acc, builder.fmul(builder.sitofp(dot, _V8F), scale, flags=("contract",)),
                                flags=("contract",))
            macc2 = macc if m is None else builder.fadd(macc, builder.fmul(m, builder.load(builder.gep(xs_p, [b]))))
            nxt, end = builder.add(b, ir.Constant(i64, 1)), builder.block
            for phi, first, later in ((b, zero64, nxt), (acc, zf, acc2), (macc, fzero, macc2)):
                phi.add_incoming(first, entry)
                phi.add_incoming(later, end)
            builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
            builder.position_at_end(done)
            ta, tm = builder.phi(_V8F), builder.phi(_F32)
            for phi, first, later in ((ta, zf, acc2), (tm, fzero, macc2)):
                phi.add_incoming(first, entry)
                phi.add_incoming(later, end)
            return builder.fadd(_hsum8(builder, ta), tm)
        return types.float32(row, nb, xq, xd, xs), codegen
    dot.__name__ = f"_dot_vnni_{nbytes}"
    return intrinsic(dot)


_dot_q4_1_vnni = _vnni_dot(_q4_1_block, 20)
_dot_q8_0_vnni = _vnni_dot(_q8_0_block, 34)


@njit(**_OPTS)
def _dot_q4_1_loops(row, nb, xq, xd, xs):
    """:func:`_dot_q4_1_vnni`'s sums as plain loops (no VNNI)."""
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
def _dot_q8_0_loops(row, nb, xq, xd, xs):
    """:func:`_dot_q8_0_vnni`'s sums as plain loops (no VNNI)."""
    total = np.float32(0.0)
    for b in range(nb):
        p = 34 * b
        s = 0
        for j in range(32):
            s += np.int32(np.int8(row[p + 2 + j])) * np.int32(xq[32 * b + j])
        total += _scale(row, p) * xd[b] * np.float32(s)
    return total


def _build(dot):
    @njit(parallel=True, **_OPTS)
    def matvec(data, x, out, chunks):
        """``out = x @ W.T`` for a matrix ``data`` of the dot's type (out, blocks · bytes) and a few rows x (n, k),
        each quantized to 8 bits per block of 32; the output rows in ``chunks`` ranges on numba's threads."""
        rows, k = x.shape
        nb = k // 32
        xq, xd, xs = np.empty((rows, k), np.int8), np.empty((rows, nb), np.float32), np.empty((rows, nb), np.float32)
        for i in range(rows):
            quantize_q8(x[i], xq[i], xd[i], xs[i])
        n = data.shape[0]
        for c in prange(chunks):
            for i in range(rows):
                for r in range(c * n // chunks, (c + 1) * n // chunks):
                    out[i, r] = dot(data[r], nb, xq[i], xd[i], xs[i])
    return matvec


matvec_q4_1_q8 = _build(_dot_q4_1_vnni if VNNI else _dot_q4_1_loops)
matvec_q8_0_q8 = _build(_dot_q8_0_vnni if VNNI else _dot_q8_0_loops)


@njit(**_OPTS)
def matvec_q8(kind, data, x, out, chunks):
    """The product of :data:`KINDS`' ``kind`` (2: Q4_1, 3: Q8_0) with 8-bit activations."""
    if kind == 2:
        matvec_q4_1_q8(data, x, out, chunks)
    else:
        matvec_q8_0_q8(data, x, out, chunks)
