"""The compiled kernels of :class:`qkv.models._quant.QuantMatrix` (numba, the ``jit`` extra). Imported by
:mod:`qkv.models._quant` the first time a quantized matrix multiplies, where numba is installed.

Each weight row is the file's bytes: blocks of ``bs`` weights in ``ts`` bytes (ggml's layouts, as
``gguf.quants`` and llama.cpp's ``ggml-quants.c`` read them; the kind codes are :data:`qkv.models._quant.KINDS`'s).
:func:`_block` dequantizes one block into float32 with the operations and the order of ``gguf.quants.dequantize``
(no fast-math: no FMA contraction), so :func:`dequantize_rows` equals gguf's bit for bit.

:func:`matvec_par` / :func:`matvec` (few rows ``x``, the decoding step): one pass over the bytes; per block
the weights are dequantized into a small buffer (L1) and multiplied into 32 accumulators per row of ``x``
(lanes ``j`` of each 32 weights: no reduction inside the loop, so LLVM vectorizes it without reassociation);
each output is the sum of its 32 lanes at the row's end. ``matvec_par`` splits the output rows in ``chunks``
even ranges over numba's threads (``prange``).
"""
from __future__ import annotations

import platform
from types import MappingProxyType

import llvmlite.binding as _llvm
import llvmlite.ir as ir
import numpy as np
from numba import config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["MAX_THREADS", "dequantize_rows", "matvec", "matvec_par"]

#: numba's threads (``NUMBA_NUM_THREADS``): the most that :func:`matvec_par` spreads over.
MAX_THREADS = int(config.NUMBA_NUM_THREADS)
# numba's OpenMP layer (libgomp) keeps its idle threads spinning a while before they sleep (its default, left
# as the environment sets it: OMP_WAIT_POLICY, GOMP_SPINCOUNT). On an idle machine that is what a decoding step's
# ~150 parallel calls want (SmolLM2, 2 threads: 15.8 ms a token against 37.7 with OMP_WAIT_POLICY=PASSIVE); on
# cores another process keeps busy, set OMP_WAIT_POLICY=PASSIVE (there spinning cost 285–507 ms a token, passive
# waiting 38). docs/models.md says so.

_OPTS = MappingProxyType(dict(nogil=True, cache=True, error_model="numpy", boundscheck=False))   # no fast-math
_F = np.float32
#: 2^(e − 25) for a float16 exponent field e: a normal half is (1024 + mantissa)·2^(e − 25) exactly.
_POW2 = np.array([2.0 ** (e - 25) for e in range(32)], np.float32)
# the kind codes (qkv.models._quant.TYPES' last column)
_Q4_0, _Q4_1, _Q8_0, _Q4_K, _Q6_K = 1, 2, 3, 4, 5
#: Whether LLVM converts float16 with an instruction here (x86's F16C, ARM64): else :func:`_half`'s arithmetic.
_NATIVE_HALF = (platform.machine().lower() in ("aarch64", "arm64")
                or bool(_llvm.get_host_cpu_features().get("f16c", False)))
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


# ---------------------------------------------------------------------------------------------- intrinsics
# 16 weights at a time as LLVM vectors (<16 x i8> loaded, widened, converted, scaled, stored): numba's own
# loops over 16 bytes were not vectorized (LLVM cannot prove the uint8 source and the float32 destination
# apart), 0.6 ns a weight; these take 0.1 ns with the dot product. Offsets are in elements; the callers keep
# them inside the arrays (no bounds checks).
def _ptr(context, builder, aty, arr, offset, elem):
    """A pointer to ``arr[offset]`` as ``elem*``."""
    a = context.make_array(aty)(context, builder, arr)
    return builder.bitcast(builder.gep(a.data, [offset]), elem.as_pointer())


#: Bytes ahead of the block being multiplied that the kernels ask the memory for (``prefetcht0``, once a block):
#: the hardware's own prefetching left one thread streaming SmolLM2-sized matrices from DRAM at 4.4 GB/s; with
#: 2 KiB ahead, 13.6 GB/s (2 threads: 8.7 → 26.8 GB/s; 1 KiB: 23.7, 512 B: 16.3; the Intel Xeon of RESULTS.md).
PREFETCH = 2048


def prefetch_ahead(builder, base):
    """Ask for the cache line :data:`PREFETCH` bytes after byte pointer ``base`` (for reading, kept in all
    levels): a hint, no fault if it lies past the array."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer()] + [_I32] * 3),
                                        "llvm.prefetch")
    builder.call(fn, [builder.gep(base, [ir.Constant(ir.IntType(64), PREFETCH)]), ir.Constant(_I32, 0),
                      ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


@intrinsic
def _prefetch(typingctx, arr, offset):
    """:func:`prefetch_ahead` of ``arr[offset]`` (a uint8 array)."""
    def codegen(context, builder, sig, args):
        prefetch_ahead(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _I8))
        return context.get_dummy_value()
    return types.void(arr, offset), codegen


def _splat(builder, value, n: int = 16):
    """``value`` in every lane of an n-vector."""
    vt = ir.VectorType(value.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _bytes16(context, builder, aty, arr, offset, extend):
    """The 16 bytes at ``arr[offset:]`` as <16 x i32> (``extend``: zext or sext)."""
    v = builder.load(_ptr(context, builder, aty, arr, offset, ir.VectorType(_I8, 16)), align=1)
    return extend(v, ir.VectorType(_I32, 16))


def _store16(context, builder, aty, arr, offset, w):
    builder.store(w, _ptr(context, builder, aty, arr, offset, ir.VectorType(_F32, 16)), align=4)


@intrinsic
def _f16(typingctx, row, p):
    """The float16 at ``row[p:p + 2]`` (uint8) as float32 (``fpext``: exact)."""
    def codegen(context, builder, sig, args):
        h = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _I16), align=1)
        return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)
    return types.float32(row, p), codegen


@intrinsic
def _nib16(typingctx, row, p, shift, ib, d, a, add, dst, o):
    """``dst[o:o + 16] = d · f32(((row[p:p + 16] >> shift) & 15) + ib)``, then ``+ a`` when ``add``."""
    def codegen(context, builder, sig, args):
        row_, p_, shift_, ib_, d_, a_, add_, dst_, o_ = args
        q = builder.lshr(_bytes16(context, builder, sig.args[0], row_, p_, builder.zext),
                         _splat(builder, builder.trunc(shift_, _I32)))
        q = builder.add(builder.and_(q, _splat(builder, ir.Constant(_I32, 15))),
                        _splat(builder, builder.trunc(ib_, _I32)))
        w = builder.fmul(_splat(builder, d_), builder.sitofp(q, ir.VectorType(_F32, 16)))
        w = builder.select(add_, builder.fadd(w, _splat(builder, a_)), w)
        _store16(context, builder, sig.args[7], dst_, o_, w)
        return context.get_dummy_value()
    return types.void(row, p, shift, ib, d, a, add, dst, o), codegen


@intrinsic
def _i8x16(typingctx, row, p, d, dst, o):
    """``dst[o:o + 16] = f32(int8(row[p:p + 16])) · d``."""
    def codegen(context, builder, sig, args):
        row_, p_, d_, dst_, o_ = args
        q = _bytes16(context, builder, sig.args[0], row_, p_, builder.sext)
        _store16(context, builder, sig.args[3], dst_, o_,
                 builder.fmul(builder.sitofp(q, ir.VectorType(_F32, 16)), _splat(builder, d_)))
        return context.get_dummy_value()
    return types.void(row, p, d, dst, o), codegen


@intrinsic
def _q6x16(typingctx, row, pl, sl, ph, sh, s, dst, o):
    """``dst[o:o + 16] = s · f32(((row[pl:] >> sl) & 15 | ((row[ph:] >> sh) & 3) << 4) − 32)`` (16 lanes)."""
    def codegen(context, builder, sig, args):
        row_, pl_, sl_, ph_, sh_, s_, dst_, o_ = args
        aty = sig.args[0]

        def bits(offset, shift, mask):
            v = builder.lshr(_bytes16(context, builder, aty, row_, offset, builder.zext),
                             _splat(builder, builder.trunc(shift, _I32)))
            return builder.and_(v, _splat(builder, ir.Constant(_I32, mask)))
        q = builder.or_(bits(pl_, sl_, 15), builder.shl(bits(ph_, sh_, 3), _splat(builder, ir.Constant(_I32, 4))))
        q = builder.sub(q, _splat(builder, ir.Constant(_I32, 32)))
        _store16(context, builder, sig.args[6], dst_, o_,
                 builder.fmul(_splat(builder, s_), builder.sitofp(q, ir.VectorType(_F32, 16))))
        return context.get_dummy_value()
    return types.void(row, pl, sl, ph, sh, s, dst, o), codegen


def _hsum(builder, v):
    """The sum of the 16 lanes of ``v``, halves added (16 → 8 → 4 → 2 → 1): a fixed order."""
    for width in (8, 4, 2, 1):
        lo, hi = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width), list(range(a, a + width))))
                  for a in (0, width))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _row_dot(kind: int):
    """An intrinsic ``f(row, nb, x)``: Σ W[row]·x over the ``nb`` blocks of 32 weights of one row of ``kind``
    (Q4_0, Q4_1 or Q8_0), as one LLVM loop: per block, the weights dequantized as :func:`_block` does (exact),
    then multiplied by x and added into two <16 x float> accumulators (an FMA: ``contract`` on that product
    and sum only), kept in registers across the row; summed at the end (halves added: 16 → 1)."""
    ts = {_Q4_0: 18, _Q4_1: 20, _Q8_0: 34}[kind]
    v16f, v16i = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)

    def weights(builder, base):
        """The block at byte pointer ``base`` as two <16 x float>."""
        def half(offset):
            h = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), offset)]),
                                             _I16.as_pointer()), align=1)
            return _splat(builder, builder.fpext(builder.bitcast(h, ir.HalfType()), _F32))

        def load16(offset, extend):
            p = builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), offset)]),
                                ir.VectorType(_I8, 16).as_pointer())
            return extend(builder.load(p, align=1), v16i)
        d = half(0)
        if kind == _Q8_0:
            return [builder.fmul(builder.sitofp(load16(o, builder.sext), v16f), d) for o in (2, 18)]
        b = load16(4 if kind == _Q4_1 else 2, builder.zext)
        qs = [builder.and_(b, ir.Constant(v16i, [15] * 16)), builder.lshr(b, ir.Constant(v16i, [4] * 16))]
        if kind == _Q4_0:
            return [builder.fmul(d, builder.sitofp(builder.sub(q, ir.Constant(v16i, [8] * 16)), v16f)) for q in qs]
        m = half(2)
        return [builder.fadd(builder.fmul(d, builder.sitofp(q, v16f)), m) for q in qs]

    @intrinsic
    def row_dot(typingctx, row, nb, x):
        def codegen(context, builder, sig, args):
            row_p = _ptr(context, builder, sig.args[0], args[0], ir.Constant(ir.IntType(64), 0), _I8)
            x_p = _ptr(context, builder, sig.args[2], args[2], ir.Constant(ir.IntType(64), 0), _F32)
            i64 = ir.IntType(64)
            n = args[1]
            entry = builder.block
            loop, done = builder.append_basic_block("rowdot.loop"), builder.append_basic_block("rowdot.done")
            zero = ir.Constant(v16f, [0.0] * 16)
            builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
            builder.position_at_end(loop)
            b = builder.phi(i64)
            accs = [builder.phi(v16f), builder.phi(v16f)]
            base = builder.gep(row_p, [builder.mul(b, ir.Constant(i64, ts))])
            prefetch_ahead(builder, base)
            ws = weights(builder, base)
            new = []
            for j, (acc, w) in enumerate(zip(accs, ws)):
                xp = builder.bitcast(builder.gep(x_p, [builder.add(builder.mul(b, ir.Constant(i64, 32)),
                                                                   ir.Constant(i64, 16 * j))]), v16f.as_pointer())
                prod = builder.fmul(w, builder.load(xp, align=4), flags=("contract",))
                new.append(builder.fadd(acc, prod, flags=("contract",)))
            nxt = builder.add(b, ir.Constant(i64, 1))
            body_end = builder.block
            b.add_incoming(ir.Constant(i64, 0), entry)
            b.add_incoming(nxt, body_end)
            for acc, v in zip(accs, new):
                acc.add_incoming(zero, entry)
                acc.add_incoming(v, body_end)
            builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
            builder.position_at_end(done)
            tot = [builder.phi(v16f), builder.phi(v16f)]
            for t, v in zip(tot, new):
                t.add_incoming(zero, entry)
                t.add_incoming(v, body_end)
            return _hsum(builder, builder.fadd(tot[0], tot[1]))
        return types.float32(row, nb, x), codegen
    return row_dot


_dot_q4_0, _dot_q4_1, _dot_q8_0 = _row_dot(_Q4_0), _row_dot(_Q4_1), _row_dot(_Q8_0)


# ---------------------------------------------------------------------------------------------- blocks


@njit(inline="always", **_OPTS)
def _half(lo, hi):
    """The float16 in little-endian bytes ``lo``, ``hi`` as float32 (exact: subnormals, ±0, ±inf, NaN)."""
    u = np.int32(lo) | (np.int32(hi) << 8)
    e = (u >> 10) & 31
    m = u & 1023
    if e == 0:
        v = _F(m) * _POW2[1]
    elif e == 31:
        v = _F(np.inf) if m == 0 else _F(np.nan)
    else:
        v = _F(1024 + m) * _POW2[e]
    return -v if u & 32768 else v


@njit(inline="always", **_OPTS)
def _i8(v):
    """The byte ``v`` as a signed int8 value."""
    w = np.int32(v)
    return w - ((w & 128) << 1)


@njit(inline="always", **_OPTS)
def _k4_scale_min(sc, j, o):
    """Q4_K's 6-bit scale and min of sub-block ``j`` from the 12 bytes at ``sc[o:]`` (llama.cpp's
    ``get_scale_min_k4``)."""
    if j < 4:
        return np.int32(sc[o + j]) & 63, np.int32(sc[o + j + 4]) & 63
    a, b, c = np.int32(sc[o + j + 4]), np.int32(sc[o + j - 4]), np.int32(sc[o + j])
    return (a & 15) | ((b >> 6) << 4), (a >> 4) | ((c >> 6) << 4)


@njit(inline="always", **_OPTS)
def _scale(row, p):
    """The float16 at ``row[p:p + 2]`` as float32: one conversion instruction where the CPU has one."""
    if _NATIVE_HALF:
        return _f16(row, p)
    return _half(row[p], row[p + 1])


@njit(inline="always", **_OPTS)
def _block(kind, row, b, dst, o):
    """Block ``b`` of the bytes ``row`` dequantized into ``dst[o:o + bs]`` (float32), as gguf does:
    Q4_0 d·(q − 8), Q4_1 d·q + m, Q8_0 q·d, Q4_K (d·scale)·q − dmin·min, Q6_K (d·scale)·(q − 32)."""
    if kind == _Q4_1:
        p = b * 20
        d, m = _scale(row, p), _scale(row, p + 2)
        _nib16(row, p + 4, 0, 0, d, m, True, dst, o)                # weights 0–15: the low nibbles
        _nib16(row, p + 4, 4, 0, d, m, True, dst, o + 16)           # 16–31: the high nibbles
    elif kind == _Q8_0:
        p = b * 34
        d = _scale(row, p)
        _i8x16(row, p + 2, d, dst, o)
        _i8x16(row, p + 18, d, dst, o + 16)
    elif kind == _Q4_0:
        p = b * 18
        d = _scale(row, p)
        _nib16(row, p + 2, 0, -8, d, _F(0.0), False, dst, o)
        _nib16(row, p + 2, 4, -8, d, _F(0.0), False, dst, o + 16)
    elif kind == _Q4_K:
        _block_q4_k(row, b * 144, dst, o)
    else:
        _block_q6_k(row, b * 210, dst, o)


@njit(inline="always", **_OPTS)
def _block_q4_k(row, p, dst, o):
    """A Q4_K super-block (d, dmin: float16; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles) at
    ``row[p:]``: weight ``64·g + 32·h + l`` = (d·scale)·q − dmin·min of sub-block ``2g + h``, q the nibble
    ``h`` of byte ``16 + 32·g + l`` (d·scale·q + (−dmin·min): the same rounding)."""
    d, dmin = _scale(row, p), _scale(row, p + 2)
    for g in range(4):
        s0, m0 = _k4_scale_min(row, 2 * g, p + 4)
        s1, m1 = _k4_scale_min(row, 2 * g + 1, p + 4)
        d0, a0, d1, a1 = d * _F(s0), -(dmin * _F(m0)), d * _F(s1), -(dmin * _F(m1))
        for h in range(2):
            q = p + 16 + 32 * g + 16 * h
            _nib16(row, q, 0, 0, d0, a0, True, dst, o + 64 * g + 16 * h)
            _nib16(row, q, 4, 0, d1, a1, True, dst, o + 64 * g + 32 + 16 * h)


@njit(inline="always", **_OPTS)
def _block_q6_k(row, p, dst, o):
    """A Q6_K super-block (128 bytes of low nibbles ``ql``, 64 of 2-bit highs ``qh``, 16 int8 scales, d
    float16) at ``row[p:]``, as ``dequantize_row_q6_K``: in half n, weight ``128·n + 32·k + l`` from ql's
    byte ``64·n + 32·(k & 1) + l`` (its low nibble for k < 2, else its high one) and bits ``2k`` of qh's byte
    ``32·n + l``, minus 32, times d·scale[8n + 2k + l // 16]."""
    d = _scale(row, p + 208)
    for n in range(2):
        for k in range(4):
            for h in range(2):
                s = d * _F(_i8(row[p + 192 + 8 * n + 2 * k + h]))
                _q6x16(row, p + 64 * n + 32 * (k & 1) + 16 * h, 0 if k < 2 else 4, p + 128 + 32 * n + 16 * h,
                       2 * k, s, dst, o + 128 * n + 32 * k + 16 * h)


@njit(**_OPTS)
def dequantize_rows(kind, bs, data, r0, r1, out):
    """Rows ``r0 … r1 − 1`` of ``data`` (out, bytes per row) uint8 dequantized into ``out`` (r1 − r0, in)."""
    nb = out.shape[1] // bs
    for r in range(r0, r1):
        row, dst = data[r], out[r - r0]
        for b in range(nb):
            _block(kind, row, b, dst, b * bs)


@njit(fastmath={"reassoc", "contract"}, **_OPTS)
def _dot(a, b):
    """Σ a[j]·b[j] in float32, reassociated (vector lanes) and with FMAs: the order BLAS's dot may take."""
    t = _F(0.0)
    for j in range(a.shape[0]):
        t += a[j] * b[j]
    return t


@njit(inline="always", **_OPTS)
def _rows(kind, bs, data, x, out, r0, r1):
    """``out[:, r] = x · W[r]`` for r in r0 … r1 − 1 (W the dequantized ``data``): each row dequantized
    into a buffer that stays in L1, then its dot product with every row of x."""
    n, k = x.shape
    buf = np.empty(k, np.float32)
    for r in range(r0, r1):
        row = data[r]
        if kind == _Q4_1:
            for i in range(n):
                out[i, r] = _dot_q4_1(row, k // 32, x[i])
        elif kind == _Q8_0:
            for i in range(n):
                out[i, r] = _dot_q8_0(row, k // 32, x[i])
        elif kind == _Q4_0:
            for i in range(n):
                out[i, r] = _dot_q4_0(row, k // 32, x[i])
        else:
            for p in range(0, row.shape[0], 64):
                _prefetch(row, p)
            for b in range(k // bs):
                _block(kind, row, b, buf, b * bs)
            for i in range(n):
                out[i, r] = _dot(buf, x[i])


@njit(**_OPTS)
def matvec(kind, bs, data, x, out, r0, r1):
    """``out[:, r0:r1] = x @ W[r0:r1].T`` on the calling thread (see :func:`_rows`)."""
    _rows(kind, bs, data, x, out, r0, r1)


@njit(parallel=True, **_OPTS)
def matvec_par(kind, bs, data, x, out, chunks):
    """``out = x @ W.T``, the output rows in ``chunks`` even ranges on numba's threads."""
    n = data.shape[0]
    for c in prange(chunks):
        _rows(kind, bs, data, x, out, c * n // chunks, (c + 1) * n // chunks)
