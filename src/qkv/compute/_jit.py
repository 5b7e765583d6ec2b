"""The engine's fused block kernels, compiled by numba (the ``jit`` extra). Imported only by
:mod:`qkv.kernels`, the first time a block large enough to pay for it asks (importing numba takes ~0.3 s;
the compiled code is cached on disk, ``cache=True``).

Each kernel makes one pass over a block of float32 scores where NumPy makes three to six (a softcap's tanh,
the causal mask, the shift, ``exp``, the row sums): per row ``r`` of ``s``,

    s[r, c] = exp(f(s[r, c]) + add[r])   for c ≤ d + r // rep (every c when d ≥ width), else 0
    sums[r] = Σ_c s[r, c]

with ``f`` the identity or softcap's ``cap·tanh`` — so the causal diagonal (query position ``a0 + r // rep``,
key ``j0 + c``: ``d = a0 − j0``; ``rep`` interleaved heads per position) costs no mask pass.

``exp``: Cephes' reduction (``n`` = round(x/ln 2), Cody–Waite ``r = x − n·ln 2`` in two FMAs) and
``e^r = 1 + r + r²·P(r)`` with P of degree 3 fitted for relative error on |r| ≤ ln 2 / 2 (1.05e-7 in exact
arithmetic), times 2^n built in the exponent bits. The rounding is the magic-number form: ``t = x/ln 2 +
1.5·2^23 + 127`` (one FMA) leaves ``n + 127`` in t's low bits, so n is an integer subtraction and a convert,
and 2^n t's bits shifted by 23 — no round, no add of the bias. numba's fast-math pass puts ``reassoc`` on
every float operation, under which LLVM folds ``(y + c) − c`` to ``y`` and merges the Cody–Waite pair into
one product by the rounded ln 2 (the old kernel's reduction had lost its extra bits that way: 3e-7 at
|x| ≈ 88): so n comes from the bits in integer arithmetic (:func:`_n_of`, :func:`_pow2_of`) and the pair are
``llvm.fma`` calls (:func:`_fma`), which the pass leaves alone. The clamps do the edge cases: x is clamped to
[−127·ln 2, 128·ln 2], where 2^n's bits are exactly 0 (so −inf, a masked score, gives 0 with no select) and
+inf; they are written ``lo if v < lo else v``, which keeps a NaN (both tests false), and the NaN runs
through to the result — no select for it either. ``tanh``: Eigen's rational form. Both in float32
arithmetic, so that LLVM vectorizes them (AVX2/AVX-512 where the CPU has them).
Timed by ``benchmarks/bench_kernels.py`` (the figures: benchmarks/RESULTS.md, "The block kernels"). Tested against
float64 NumPy on a dense grid: relative error ≤ 2.1e-7 on [−87, 88] (float32's own ``np.exp`` ≈ 1.2e-7; the
degree-4 P measured 1.2e-7 at 8 % more time). Edge values: ``exp`` is 0 below −87.7 (n = −127; NumPy's goes
through subnormals to 0 at −103.9: values under 1.2e−38, below any row sum the engine divides by), a
subnormal from there to −87.3, and inf from 88.38 (n = 128; NumPy's from 88.72); NaN stays NaN.

``exp2`` (:func:`exp_rows` with ``base2``, the forward's shift-free blocks of unmodified scores): where the
engine has folded log₂ e into the query rows, a block's scores are already ``score·log₂ e`` and e^score = 2^s —
the rounding is then one instruction (n = roundeven(s)), the reduction ``r = s − n`` exact (no Cody–Waite pair,
no multiply by 1/ln 2), and 2^r a degree-5 polynomial: three multiply-class operations of nine fewer, about
a third less time a block, 1.66e-7 relative on [−126, 127]. A row term is added in a pass of its own (:func:`_exp2_row`).

The row max is ``llvm.maxnum`` (:func:`_maxf`), which LLVM vectorizes as a reduction; the ``a if a > b``
select it replaces did not vectorize (4× the time) — NaN is skipped by both.
"""
from __future__ import annotations

import numpy as np
import llvmlite.ir as ir
from numba import njit, types
from numba.extending import intrinsic

from qkv.compute._cblas import NO_TRANS as _NO_TRANS, ROW_MAJOR as _ROW_MAJOR, TRANS as _TRANS   # as qkv.gemm passes them

__all__ = ["ds_rows", "exp_rows", "finish_rows", "gelu_rows", "max_exp_rows", "pattern_exp_rows",
           "kt_prep", "plain_backward_rows", "plain_lazy_rows", "plain_rows", "q_prep", "swiglu_rows",
           "rms_norm_rows", "rope_rows", "col_extents"]


@intrinsic
def _n_of(typingctx, t):
    """``n`` from ``t`` = x/ln 2 + 1.5·2^23 + 127 (rounded to an integer by the addition): its bits minus the
    constant's, as float32 — in integer arithmetic, where numba's fast-math flags (``reassoc`` folds
    ``(y + c) − c`` to ``y``) do not reach."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        return builder.sitofp(builder.sub(bits, ir.Constant(i32, _ROUND_BITS)), ir.FloatType())
    return sig, codegen


@intrinsic
def _pow2_of(typingctx, t):
    """2^n from the same ``t``: its low bits (n + 127) shifted into the exponent (0 for n = −127, inf for
    128), in 32-bit lanes."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        return builder.bitcast(builder.shl(bits, ir.Constant(i32, 23)), ir.FloatType())
    return sig, codegen


@intrinsic
def _rint(typingctx, v):
    """``llvm.roundeven.f32``: ``v`` rounded to the nearest integer, ties to even — one instruction
    (``vrndscaleps``/``vroundps``), which LLVM vectorizes and fast-math cannot fold away (as it folds the magic
    number's ``(v + c) − c`` to ``v``, which is why :func:`_n_of` works on the bits)."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.roundeven", [f32], ir.FunctionType(f32, [f32]))
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """``llvm.fma.f32``: a·b + c rounded once, and kept apart — as ``a * b + c`` under ``reassoc`` LLVM merged
    the Cody–Waite pair into one product by C1 + C2, which loses the reduction's extra bits."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _maxf(typingctx, a, b):
    """``llvm.maxnum.f32(a, b)``: the larger, NaN skipped — the form LLVM vectorizes as a max reduction."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f32], ir.FunctionType(f32, [f32, f32]))
        return builder.call(fn, args)
    return sig, codegen


_F = np.float32
# No 'nnan'/'ninf': NaN and inf keep their meaning; reassociation lets the row sum vectorize.
_FLAGS = {"contract", "reassoc", "nsz", "arcp"}
_OPTS = dict(fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)

_LOG2E = _F(1.44269504088896341)
_ROUND = _F(12582912.0 + 127.0)                             # 1.5·2^23 + 127: t's ulp is 1, its bits 0x4B40007F + n
_ROUND_BITS = 0x4B40007F
_NC1, _NC2 = _F(-0.693359375), _F(2.12194440e-4)          # −ln 2 = NC1 + NC2, NC1 exact in 9 bits
# e^r = 1 + r + r²·(P0 + P1·r + P2·r² + P3·r³) on |r| ≤ ln 2 / 2 (minimax for relative error: 1.05e-7)
_P0, _P1, _P2, _P3 = _F(0.499992311000824), _F(0.16667114198207855), _F(0.04189009591937065), \
    _F(0.008312505669891834)
# 2^r = 1 + r·(E1 + r·(E2 + r·(E3 + r·(E4 + r·E5)))) on |r| ≤ 1/2 (minimax for relative error: 9.1e-8)
_E1, _E2, _E3, _E4, _E5 = _F(0.6931469775984711), _F(0.24022242084919251), _F(0.05550733744244796), \
    _F(0.009671512660561586), _F(0.001326472689895554)
# tanh: Eigen's float rational approximation (odd degree 13 over even degree 6), clamped where tanh = ±1
_A1, _A3, _A5 = _F(4.89352455891786e-03), _F(6.37261928875436e-04), _F(1.48572235717979e-05)
_A7, _A9, _A11 = _F(5.12229709037114e-08), _F(-8.60467152213735e-11), _F(2.00018790482477e-13)
_A13 = _F(-2.76076847742355e-16)
_B0, _B2, _B4, _B6 = (_F(4.89352518554385e-03), _F(2.26843463243900e-03), _F(1.18534705686654e-04),
                      _F(1.19825839466702e-06))
_TANH_CLAMP = _F(7.90531110763549805)
_XLO, _XHI = _F(-88.0296919311), _F(88.7228391117)           # −127·ln 2, 128·ln 2: 2^n's bits 0, inf
_HALF, _ONE, _ZERO, _INF = _F(0.5), _F(1.0), _F(0.0), _F(np.inf)
_NO_LO = -(1 << 62)                                          # plain_rows' lower edge that masks nothing


@njit(inline="always", **_OPTS)
def _expf_bounded(v):
    """exp without the clamps, for ``v`` in [−127·ln 2, 128·ln 2] (0 and inf at the ends): what :func:`_expf`
    computes after clamping, and what a caller whose arguments are known to lie there (a shift-free block's,
    within ±SHIFT_FREE_BOUND) calls directly (19 % less time a block)."""
    t = v * _LOG2E + _ROUND                                  # round(v/ln 2) + 127 in t's low mantissa bits
    n = _n_of(t)
    r = _fma(n, _NC1, v)                                     # Cody–Waite: two FMAs (llvm.fma: not merged)
    r = _fma(n, _NC2, r)
    p = (((_P3 * r + _P2) * r + _P1) * r + _P0) * (r * r) + r + _ONE
    return p * _pow2_of(t)


@njit(inline="always", **_OPTS)
def _exp2f_bounded(v):
    """2^v for ``v`` in [−126, 127] (no clamps): ``n`` = round(v) (:func:`_rint`, one instruction), ``r = v − n``
    exact (|r| ≤ ½: no Cody–Waite pair, no multiply by 1/ln 2), 2^r by a degree-5 polynomial fitted for
    relative error on |r| ≤ ½ (9.1e-8 in exact arithmetic), times 2^n in the exponent bits (of ``n`` plus the
    magic number, an exact sum). For blocks whose scores carry log₂ e already (the engine folds it into the
    query rows once): three multiply-class operations fewer than :func:`_expf_bounded` (32 % less time a
    block), and 1.7e-7 relative, not 2.1e-7. Eleven vector operations a vector of scores, and by my count of
    them the loop is bound by the CPU's vector pipes (Zen 4), its time following their number: n from the
    magic number's bits instead (an integer subtraction and a convert) made twelve, and 9 % more time
    (``benchmarks/bench_kernels.py``)."""
    n = _rint(v)
    r = v - n
    p = ((((_E5 * r + _E4) * r + _E3) * r + _E2) * r + _E1) * r + _ONE
    return p * _pow2_of(n + _ROUND)                          # n + 127 in the sum's low mantissa bits


@njit(inline="always", **_OPTS)
def _expf(v):
    x = _XLO if v < _XLO else v                              # −inf → n = −127: 2^n = 0 exactly (NaN stays NaN:
    x = _XHI if x > _XHI else x                              # both tests false, and NaN runs through to the end)
    return _expf_bounded(x)


@njit(inline="always", **_OPTS)
def _tanhf(v):
    x = v if v < _TANH_CLAMP else _TANH_CLAMP
    x = x if x > -_TANH_CLAMP else -_TANH_CLAMP
    z = x * x
    p = ((((((_A13 * z + _A11) * z + _A9) * z + _A7) * z + _A5) * z + _A3) * z + _A1) * x
    q = ((_B6 * z + _B4) * z + _B2) * z + _B0
    return v if v != v else p / q


@njit(inline="always", **_OPTS)
def _f_row(row, lim, kind, coef, cap, a):
    """``row[c] ← f(row[c]) + a`` for c < lim: ``kind`` 0 f = identity, 1 the polynomial ``y·Σ_k coef[k]·y^2k``
    (seven coefficients, zero-padded: softcap's ``cap·tanh`` fitted), 2 ``cap·tanh``."""
    if kind == 1:
        c0, c1, c2, c3, c4, c5, c6 = coef[0], coef[1], coef[2], coef[3], coef[4], coef[5], coef[6]
        if c4 == _ZERO and c5 == _ZERO and c6 == _ZERO:              # up to four terms: three FMAs fewer
            for c in range(lim):
                y = row[c]
                t = y * y
                row[c] = (((c3 * t + c2) * t + c1) * t + c0) * y + a
        else:
            for c in range(lim):
                y = row[c]
                t = y * y
                row[c] = ((((((c6 * t + c5) * t + c4) * t + c3) * t + c2) * t + c1) * t + c0) * y + a
    elif kind == 2:
        for c in range(lim):
            row[c] = cap * _tanhf(row[c]) + a
    else:
        for c in range(lim):
            row[c] = row[c] + a


@njit(inline="always", **_OPTS)
def _limit(d, r, rep, width):
    """The allowed columns of row ``r`` (query position ``r // rep`` after the diagonal's offset ``d``)."""
    lim = d + r // rep + 1
    return width if lim > width else (0 if lim < 0 else lim)


@njit(inline="always", **_OPTS)
def _exp_row(row, lim, a, expf=_expf):
    """``row[c] ← expf(row[c] + a)`` for c < lim, 0 after; returns the row's sum (``expf``: :func:`_expf`, or
    :func:`_expf_bounded` where the caller knows the range). The zeros as a slice assignment, which numba
    vectorizes: as a loop of stores they were 65 % of a 256-row causal square's time (22.8 → 9.6 µs)."""
    acc = _ZERO
    for c in range(lim):
        y = expf(row[c] + a)
        row[c] = y
        acc += y
    row[lim:] = _ZERO
    return acc


@njit(inline="always", **_OPTS)
def _exp2_row(row, lim, a):
    """:func:`_exp_row` in base 2 (:func:`_exp2f_bounded`), the row term added in a pass of its own first: in
    the exponential's loop LLVM regrouped ``(s + a) + 1.5·2²³`` as ``s + (a + 1.5·2²³)`` and hoisted the
    latter (numba puts its fast-math flags on every float operation, intrinsics' too), so n was
    round(s + round(a)), |r| up to 1 and the result 1.7e-4 off — when n came from the magic number; with
    n = roundeven(s + a) (:func:`_rint`) r and 2^n share one n, but the pass stays (no engine path adds a
    row term in base 2, so there is nothing to gain, and its test guards the regrouping). Without a row
    term, no pass."""
    if a != _ZERO:
        for c in range(lim):
            row[c] = row[c] + a
    return _exp_row(row, lim, _ZERO, _exp2f_bounded)


@njit(inline="always", **_OPTS)
def _exp_rows_with(s, add, sums, d, rep, expf):
    """:func:`exp_rows` for the identity ``f``, with the exponential ``expf`` chosen outside the row loop (a
    test per row inside it cost 15 % of the block's time)."""
    rows, width = s.shape
    for r in range(rows):
        sums[r] = _exp_row(s[r], _limit(d, r, rep, width), add[r], expf)


@njit(inline="always", **_OPTS)
def _exp2_rows(s, add, sums, d, rep):
    """:func:`exp_rows` in base 2 (the identity ``f``)."""
    rows, width = s.shape
    for r in range(rows):
        sums[r] = _exp2_row(s[r], _limit(d, r, rep, width), add[r])


@njit(**_OPTS)
def exp_rows(s, kind, coef, cap, add, sums, d, rep, bounded=False, base2=False):
    """``s[r, c] = exp(f(s[r, c]) + add[r])`` where ``c ≤ d + r // rep``, else 0 (``f`` by ``kind``, as
    :func:`_f_row`); ``sums[r]`` the row's sum. The identity's add rides in the exponential's loop; a softcap
    first rewrites the row (in L1), then the exponential reads it. ``bounded``: the caller knows every
    ``f(s) + add`` lies in [−87, 88] (:func:`_expf_bounded`, without the clamps). ``base2`` (``f`` the identity):
    the scores carry log₂ e already (the engine folds it into the query rows), so the exponential is 2^x,
    without clamps (:func:`_exp2f_bounded`: every argument within [−126, 127])."""
    if kind == 0:
        if base2:
            _exp2_rows(s, add, sums, d, rep)
        elif bounded:
            _exp_rows_with(s, add, sums, d, rep, _expf_bounded)
        else:
            _exp_rows_with(s, add, sums, d, rep, _expf)
        return
    rows, width = s.shape
    for r in range(rows):
        row = s[r]
        lim = _limit(d, r, rep, width)
        _f_row(row, lim, kind, coef, cap, add[r])
        if bounded:
            sums[r] = _exp_row(row, lim, _ZERO, _expf_bounded)
        else:
            sums[r] = _exp_row(row, lim, _ZERO)


@njit(**_OPTS)
def max_exp_rows(s, kind, coef, cap, add, sums, d, rep, seen, shift, hit):
    """The running max's pass, fused: per row, ``v = f(s[r, c]) + add[r]`` on the allowed columns (``f`` by
    ``kind``, as :func:`_f_row`), its max ``m``; the shift ``shift[r]`` = ``max(m, 0)`` where ``seen[r]`` (the
    row had a max already: ``v`` is relative to it), else ``m`` (0 when the row has no finite score: ``hit[r]``
    False); then ``s[r, c] = exp(v − shift[r])`` (0 where masked) and ``sums[r]``. The engine's max pass
    (``m_blk``, ``shift``, the subtraction, ``exp``, the row sums) in passes over each row while it is in L1."""
    rows, width = s.shape
    for r in range(rows):
        row = s[r]
        lim = _limit(d, r, rep, width)
        a = add[r]
        if kind != 0:                                        # f(s) + add written into the row (in L1)
            _f_row(row, lim, kind, coef, cap, a)
            a = _ZERO
        shift[r], hit[r], sums[r] = _max_exp_row(row, lim, a, seen[r])


@njit(inline="always", **_OPTS)
def _max_exp_row(row, lim, a, seen_r):
    """:func:`max_exp_rows` on one row of ``v = row + a``: ``(shift, hit, sum)``."""
    m = -_INF
    for c in range(lim):
        m = _maxf(m, row[c])
    m = m + a                                                # max(s + a) = max(s) + a: rounding is monotone
    h = m > -_INF and m < _INF
    if seen_r:
        sh = m if m > _ZERO else _ZERO
    else:
        sh = m if h else _ZERO
    return sh, h, _exp_row(row, lim, a - sh)


@njit(**_OPTS)
def swiglu_rows(gate_up, width):
    """SwiGLU in place: ``gate_up`` (n, 2·width) = [g | u] per row; ``g ← g·u / (1 + e^(−g))`` (silu(g)·u, the
    same operations as NumPy's four passes, in one)."""
    for r in range(gate_up.shape[0]):
        row = gate_up[r]
        for c in range(width):
            g = row[c]
            row[c] = g * row[width + c] / (_ONE + _expf(-g))


@njit(**_OPTS)
def gelu_rows(h, p, q):
    """Exact GELU in place on ``h`` (n, F): ``h·½(1 + erf(h/√2))`` with ``erf`` the rational approximation of
    :func:`qkv.models.bert.erf` — ``z`` = clip(h/√2, ±4), numerator ``z·P(z²)`` (``p``: seven coefficients,
    highest first), denominator ``Q(z²)`` (``q``: five) — the same operations as NumPy's eleven passes, in one."""
    inv_sqrt2 = _F(0.7071067811865476)
    four = _F(4.0)
    for r in range(h.shape[0]):
        row = h[r]
        for c in range(h.shape[1]):
            x = row[c]
            z = x * inv_sqrt2
            z = z if z < four else four
            z = z if z > -four else -four
            z2 = z * z
            n = p[0] * z2 + p[1]
            for k in range(2, 7):
                n = n * z2 + p[k]
            d = q[0] * z2 + q[1]
            for k in range(2, 5):
                d = d * z2 + q[k]
            row[c] = x * ((n * z / d + _ONE) * _HALF)


@njit(**_OPTS)
def pattern_exp_rows(s, kind, coef, cap, pat, sums):
    """Bands (a sliding window's cell rows): ``s`` (nb, h, w), ``s[b, r, c] = exp(f(s[b, r, c]) + pat[r, c])``
    (``f`` by ``kind``, as :func:`_f_row`; ``pat`` (h, w) the bands' shared 0/−inf mask), ``sums[b·h + r]``."""
    nb, h, w = s.shape
    for b in range(nb):
        for r in range(h):
            row = s[b, r]
            p = pat[r]
            if kind != 0:
                _f_row(row, w, kind, coef, cap, _ZERO)
            acc = _ZERO
            for c in range(w):
                y = _expf(row[c] + p[c])
                row[c] = y
                acc += y
            sums[b * h + r] = acc


@njit(**_OPTS)
def ds_rows(dp, p, D):
    """The backward's ``dS' = P ∘ (dP − D)`` in place of ``dp`` (rows × keys), ``D`` per row: one pass for two."""
    _ds_rows(dp, p, D)


@njit(inline="always", **_OPTS)
def _ds_rows(dp, p, D):
    """:func:`ds_rows`' loop, compiled into its callers (the compiled backward's too: a module global that is not
    a public kernel, so that a test wrapping ``ds_rows`` in Python leaves the loops that call it compilable)."""
    for r in range(dp.shape[0]):
        row, pr, dr = dp[r], p[r], D[r]
        for c in range(dp.shape[1]):
            row[c] = pr[c] * (row[c] - dr)


@njit(**_OPTS)
def _now(clock, clock_id, ts):
    clock(clock_id, ts.ctypes.data)
    return ts[0] + 1e-9 * ts[1]


@njit(inline="always", **_OPTS)
def _gemm(sgemm, clock, clock_id, timing, ts, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc):
    """``C = op(A)·op(B) + beta·C`` by ``sgemm`` (row-major; ``a``, ``b``, ``c`` addresses, leading dimensions in
    floats); the call's seconds on ``clock_id`` when ``timing``, else 0."""
    t0 = _now(clock, clock_id, ts) if timing else 0.0
    sgemm(_ROW_MAJOR, ta, tb, m, n, k, _ONE, a, lda, b, ldb, beta, c, ldc)
    return _now(clock, clock_id, ts) - t0 if timing else 0.0


@njit(inline="always", **_OPTS)
def _forward_layout(qs, k_t, v, acc, s_flat):
    """The forward loops' value width, leading dimensions, base pointers and the clock's scratch: ``(ev, lda,
    ldk, ldv, lacc, qp, kp, vp, ap, sp, ts)``."""
    return (v.shape[1], qs.shape[1], k_t.strides[0] // 4, v.strides[0] // 4, acc.strides[0] // 4,
            qs.ctypes.data, k_t.ctypes.data, v.ctypes.data, acc.ctypes.data, s_flat.ctypes.data,
            np.zeros(2, np.int64))


@njit(inline="always", **_OPTS)
def _fits(r0, r1, j0, j1, rows, keys, scratch):
    """Whether block rows r0 … r1 × keys j0 … j1 lie within ``rows`` × ``keys`` and its scores in ``scratch``."""
    return 0 <= r0 < r1 <= rows and 0 <= j0 < j1 <= keys and (r1 - r0) * (j1 - j0) <= scratch


@njit(inline="always", **_OPTS)
def _tile_rows(s, tile, sums, rep):
    """``s[r, c] *= tile[r // rep, c]`` (0 or 1: a block mask's partial cell), ``sums[r]`` the row's new sum."""
    rows, width = s.shape
    for r in range(rows):
        row = s[r]
        mrow = tile[r // rep]
        total = _ZERO
        for c in range(width):
            x = row[c] * mrow[c]
            row[c] = x
            total += x
        sums[r] = total


@njit(inline="always", **_OPTS)
def _exp2_band_rows(s, sums, d, lo, rep):
    """:func:`_exp2_rows` without a row term, for a block of a band in i − j: row ``r`` keeps columns ``c`` with
    ``lo + r // rep ≤ c ≤ d + r // rep`` (a sliding window's two edges in one block), 0 elsewhere."""
    rows, width = s.shape
    for r in range(rows):
        row = s[r]
        hi = _limit(d, r, rep, width)
        a = lo + r // rep
        a = 0 if a < 0 else (hi if a > hi else a)
        row[:a] = _ZERO
        sums[r] = _exp_row(row[a:], hi - a, _ZERO, _exp2f_bounded)     # 2^s on a … hi, zeros after


@njit(**_OPTS)
def plain_rows(sgemm, clock, clock_id, timing, qs, k_t, v, blocks, tiles, s_flat, acc, l_i, sums, zeros, rep):
    """The engine's shift-free blocks of plain scores (no mod, no mask but the causal diagonal; scores carry
    log₂ e) in one compiled loop: per block ``(r0, r1, j0, j1, d, fresh)`` of ``blocks`` (rows r0 … r1 of
    ``qs``, keys j0 … j1, the diagonal's offset ``d`` as :func:`exp_rows`), the scores
    ``s = qs[r0:r1, :E] · k_t[:E, j0:j1]`` and ``acc[r0:r1] (+)= p · v[j0:j1]`` by ``sgemm`` (a CBLAS sgemm
    as a ctypes function: NumPy's own OpenBLAS or MKL, the engine's GEMM provider — so the products are the
    provider's, as :func:`qkv.gemm.matmul` would compute them, accumulated by its beta), ``p = 2^s`` with
    row sums into ``l_i`` (:func:`exp_rows`, base 2) — written where ``fresh`` (the rows' first block), else
    added. What the Python loop did between these calls (slices, views, the adds, ~1 ms a 1024-row task) is
    gone. ``timing``: each GEMM's time and flops added to ``clock``'s ``[seconds, flops]`` (see
    :attr:`qkv.gemm.NumpyGemm.clock`), read with ``clock`` (libc's ``clock_gettime``) on ``clock_id``
    (:data:`qkv.kernels.GEMM_CLOCK`: ``time.CLOCK_MONOTONIC``, as ``time.perf_counter``).

    A block mask's partial cells: a seventh column ``t`` of ``blocks`` (−1: none) names the tile
    ``tiles[t]`` (0/1 per query position and key, (positions, keys) of the block at least) that multiplies
    the block's probabilities — the mask applied after the exponential (every score is within the shift-free
    bound, masked or not), the row sums taken again. Blocks of six columns have no tiles. An eighth column
    ``lo`` (−2⁶², ``qkv.kernels.NO_LO``: none) is a lower edge as ``d`` is the upper one: key ``j0 + c``
    allowed for row ``r`` where ``c ≥ lo + r // rep`` (:func:`_exp2_band_rows`: a band in i − j, a sliding
    window's, without tiles). A ninth column ``t0`` is the tile's row origin: row ``r`` of the block reads the
    tile's row ``t0 + r // rep`` (a cell's piece whose first rows an earlier piece already took starts
    inside its tile; without it, 0)."""
    E = k_t.shape[0] - 1
    ev, lda, ldk, ldv, lacc, qp, kp, vp, ap, sp, ts = _forward_layout(qs, k_t, v, acc, s_flat)
    spent = flops = 0.0
    tiled = blocks.shape[1] > 6
    banded = blocks.shape[1] > 7
    origin = blocks.shape[1] > 8
    for b in range(blocks.shape[0]):
        r0, r1, j0, j1, d, fresh = (blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3], blocks[b, 4],
                                    blocks[b, 5])
        t = blocks[b, 6] if tiled else -1
        lo = blocks[b, 7] if banded else _NO_LO
        t0 = blocks[b, 8] if origin else 0
        if not _fits(r0, r1, j0, j1, qs.shape[0], k_t.shape[1], s_flat.shape[0]) or not (
                t < 0 or (t < tiles.shape[0] and 0 <= t0 and t0 + (r1 - r0 - 1) // rep < tiles.shape[1]
                          and j1 - j0 <= tiles.shape[2])):
            raise ValueError("plain_rows: a block outside its buffers")     # the GEMM writes raw memory
        m, w = r1 - r0, j1 - j0
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, w, E,
                       qp + 4 * r0 * lda, lda, kp + 4 * j0, ldk, _ZERO, sp, w)                    # s = Q·Kᵀ
        s = s_flat[:m * w].reshape(m, w)
        if lo != _NO_LO:
            _exp2_band_rows(s, sums, d, lo, rep)          # a band's lower edge as well
        else:
            _exp2_rows(s, zeros, sums, d, rep)            # exp_rows' base 2, compiled in alone
        if t >= 0:
            _tile_rows(s, tiles[t, t0:], sums, rep)       # the partial cell's mask, the row sums again
        for r in range(m):                                   # (a loop: as an array expression it tripled
            l_i[r0 + r] = sums[r] if fresh else l_i[r0 + r] + sums[r]   # the loop's compile time, 3.1 → 1.2 s)
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, ev, w, sp, w,
                       vp + 4 * j0 * ldv, ldv, _ZERO if fresh else _ONE, ap + 4 * r0 * lacc, lacc)  # acc (+)= p·V
        flops += 2.0 * m * w * (E + ev)
    return spent, flops if timing else 0.0


@njit(**_OPTS)
def plain_backward_rows(sgemm, clock, clock_id, timing, qs, do, lse_neg, dd, k, k_t, v, blocks, j0, j1, s_buf,
                        dp_buf, sums, dk, dv, dq):
    """The backward's blocks of one query head against keys j0 … j1 (no mod, no mask but the causal diagonal),
    in one compiled loop: per block ``(i0, i1, c0, c1, d)`` of ``blocks`` (query rows, keys within j0 … j1,
    the diagonal's offset as :func:`exp_rows`), ``P = exp(qs·k_tᵀ − lse)`` recomputed, ``dv += Pᵀ·dO``,
    ``dP = dO·Vᵀ``, ``dS = P ∘ (dP − D)`` (:func:`ds_rows`), ``dk += dSᵀ·qs``, ``dq[i0:i1] += dS·k`` — the five
    products by ``sgemm`` (as :func:`plain_rows`), the three accumulations by its beta. ``dk``/``dv`` are the key
    block's rows of the gradients, ``dq`` this head's partial (L, E). ``timing``: as :func:`plain_rows`."""
    E = qs.shape[1]
    ev = do.shape[1]
    ldk = k_t.strides[0] // 4
    qp, dop, kp, ktp, vp = qs.ctypes.data, do.ctypes.data, k.ctypes.data, k_t.ctypes.data, v.ctypes.data
    sp, dpp, dkp, dvp, dqp = s_buf.ctypes.data, dp_buf.ctypes.data, dk.ctypes.data, dv.ctypes.data, dq.ctypes.data
    ts = np.zeros(2, np.int64)
    spent = 0.0
    flops = 0.0
    for b in range(blocks.shape[0]):
        i0, i1, c0, c1, d = blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3], blocks[b, 4]
        if not (_fits(i0, i1, c0, c1, qs.shape[0], min(j1, k.shape[0]), min(s_buf.shape[0], dp_buf.shape[0]))
                and c0 >= j0 and j1 - j0 <= dk.shape[0]):
            raise ValueError("plain_backward_rows: a block outside its buffers")   # the GEMMs write raw memory
        m, n, o = i1 - i0, c1 - c0, c0 - j0
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, n, E, qp + 4 * i0 * E, E,
                       ktp + 4 * c0, ldk, _ZERO, sp, n)                       # S = Q·Kᵀ (scale in qs)
        p = s_buf[:m * n].reshape(m, n)
        _exp_rows_with(p, lse_neg[i0:i1], sums, d, 1, _expf)               # P = exp(S − lse)
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _TRANS, _NO_TRANS, n, ev, m, sp, n,
                       dop + 4 * i0 * ev, ev, _ONE, dvp + 4 * o * ev, ev)     # dV += Pᵀ·dO
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _TRANS, m, n, ev, dop + 4 * i0 * ev, ev,
                       vp + 4 * c0 * ev, ev, _ZERO, dpp, n)                   # dP = dO·Vᵀ
        dp = dp_buf[:m * n].reshape(m, n)
        _ds_rows(dp, p, dd[i0:i1])                                           # dS = P ∘ (dP − D)
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _TRANS, _NO_TRANS, n, E, m, dpp, n,
                       qp + 4 * i0 * E, E, _ONE, dkp + 4 * o * E, E)          # dK += dSᵀ·Q
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, E, n, dpp, n,
                       kp + 4 * c0 * E, E, _ONE, dqp + 4 * i0 * E, E)         # dQ += dS·K
        flops += 2.0 * m * n * (3 * E + 2 * ev)
    return spent, flops if timing else 0.0


@njit(**_OPTS)
def plain_lazy_rows(sgemm, clock, clock_id, timing, qs, k_t, v, blocks, s_flat, acc, l_i, m_i, seen, sums, zeros,
                    rep, lazy, row_limit):
    """:func:`plain_rows` for blocks whose scores are not bounded (no mod, no mask but the causal diagonal):
    the engine's lazy rescaling, compiled. Per block ``(r0, r1, j0, j1, d, _)``: ``qs[rows, E] = −m_i`` so the
    product is ``s − m_i`` (``k_t``'s last row is ones); where every row has a max already (``seen``) and
    ``lazy``, ``p = exp(s − m_i)`` as is, kept when every row sum is at most ``row_limit``; otherwise (or when
    a sum is larger, the block's product made again) the running max's pass (:func:`max_exp_rows`): the shift,
    ``acc`` and ``l_i`` rescaled by ``exp(−shift)``, ``m_i`` raised, ``seen`` set where a row met a finite
    score. ``acc (+)= p·V`` by the GEMM's beta — written where none of the rows had a max (their acc was 0).
    The Python loop's steps (:func:`qkv.backends.tiled.forward_pass._lazy_block`, :func:`~qkv.backends.tiled.forward_pass._max_pass_block`),
    in its order."""
    E1 = k_t.shape[0]
    ev, lda, ldk, ldv, lacc, qp, kp, vp, ap, sp, ts = _forward_layout(qs, k_t, v, acc, s_flat)
    spent = flops = 0.0
    for b in range(blocks.shape[0]):
        r0, r1, j0, j1, d = blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3], blocks[b, 4]
        if not _fits(r0, r1, j0, j1, qs.shape[0], k_t.shape[1], s_flat.shape[0]):
            raise ValueError("plain_lazy_rows: a block outside its buffers")   # the GEMM writes raw memory
        m, w = r1 - r0, j1 - j0
        all_seen = True
        any_seen = False
        for r in range(r0, r1):
            qs[r, E1 - 1] = -m_i[r]
            all_seen = all_seen and seen[r]
            any_seen = any_seen or seen[r]
        s = s_flat[:m * w].reshape(m, w)
        sm = sums[:m]
        passes = 1
        if lazy and all_seen:
            spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, w, E1,
                           qp + 4 * r0 * lda, lda, kp + 4 * j0, ldk, _ZERO, sp, w)   # s − m_i
            flops += 2.0 * m * w * E1
            _exp_rows_with(s, zeros, sm, d, rep, _expf)              # p = exp(s − m_i), m_i unchanged
            small = True
            for r in range(m):
                if not sm[r] <= row_limit:                           # (NaN too)
                    small = False
            if small:
                for r in range(m):
                    l_i[r0 + r] += sm[r]
                passes = 0
            else:
                passes = 2                                           # grew too much: the product again
        if passes:
            spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, w, E1,
                           qp + 4 * r0 * lda, lda, kp + 4 * j0, ldk, _ZERO, sp, w)
            flops += 2.0 * m * w * E1
            for r in range(m):                                       # the running max's pass, row by row
                lim = _limit(d, r, rep, w)
                sh, h, total = _max_exp_row(s[r], lim, _ZERO, seen[r0 + r])
                if any_seen:
                    alpha = np.exp(-sh) if seen[r0 + r] else _ZERO   # exp(m_old − m_new); nothing yet: 0
                    for c in range(ev):
                        acc[r0 + r, c] *= alpha
                    l_i[r0 + r] = l_i[r0 + r] * alpha + total
                else:
                    l_i[r0 + r] = total
                m_i[r0 + r] += sh
                seen[r0 + r] = seen[r0 + r] or h
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, ev, w, sp, w,
                       vp + 4 * j0 * ldv, ldv, _ONE if any_seen or not passes else _ZERO, ap + 4 * r0 * lacc,
                       lacc)                                                 # acc (+)= p·V
        flops += 2.0 * m * ev * w
    return spent, flops if timing else 0.0


# ---------------------------------------------------------------------------------------------- a task's edges
# What the engine does around a task's compiled loop, compiled too: each one pass, without the GIL (NumPy's
# passes each took and gave back the lock — two workers handed it to and fro dozens of times a task).
_EXACT = dict(nogil=True, cache=True, error_model="numpy", boundscheck=False)   # no fast-math: as NumPy rounds


@njit(**_OPTS)
def q_prep(flat, g, n, E, hs, rs, out, scale):
    """``out[r·g + h, :E] = q[h, r]·scale`` and ``out[:, E] = 0``, where ``q[h, r, e] = flat[h·hs + r·rs + e]``
    (the ``g`` query heads of a task, ``n`` rows each, as strides into a C-contiguous 1-D view of their memory:
    a strided (g, n, E) view — a model's Q, heads side by side in its rows — read element by element ran 5×
    slower than contiguous rows); float32, one rounding, as NumPy's multiply. Returns the largest ``|q[h, r]|²``
    of the input rows (float64 sums, reassociated; NaN where q holds one)."""
    best = 0.0
    nan = False
    for r in range(n):
        for h in range(g):
            row = r * g + h
            src = flat[h * hs + r * rs:h * hs + r * rs + E]
            dst = out[row]
            t = 0.0
            for e in range(E):
                x = src[e]
                t += np.float64(x) * np.float64(x)
                dst[e] = x * scale
            dst[E] = 0.0
            nan = nan or t != t
            best = t if t > best else best
    return np.nan if nan else best


@njit(**_EXACT)
def kt_prep(k, k_t):
    """``k_t[:E] = kᵀ`` (k (S, E)) and ``k_t[E] = 1`` in one nogil pass, returning the largest ``|k[j]|²`` (float64
    sums; NaN where k holds one): a key's row read once, written down Kᵀ's rows 32 keys at a time (each row's
    32 floats two cache lines). 0.44 against NumPy's 0.52 ms a head for the transpose alone in chunks of 512
    keys (S = 8192, E = 64), and the norms' second pass over K gone (Zen 4). (V's extent stays NumPy's: its
    SIMD max and min, NaN kept, took 55 µs for a head's 8192 × 64 where a compiled loop that keeps NaN took
    285.)"""
    S, E = k.shape
    best = 0.0
    nan = False
    for j0 in range(0, S, 32):
        for j in range(j0, min(j0 + 32, S)):
            t = 0.0
            for e in range(E):
                x = k[j, e]
                k_t[e, j] = x
                t += np.float64(x) * np.float64(x)
            nan = nan or t != t
            best = t if t > best else best
    for j in range(S):
        k_t[E, j] = 1.0
    return np.nan if nan else best


@njit(**_EXACT)
def finish_rows(acc, l_i, m_i, out, lse, want_lse):
    """A task's end: ``out[h, r] = acc[r·g + h] / l_i[r·g + h]`` (out (g, n, Ev): the task's heads, rows
    interleaved in acc) and, with ``want_lse``, ``lse[h, r] = m_i[r·g + h] + log l_i[r·g + h]`` (``m_i`` the
    shift subtracted: 0 in a shift-free task); a row with ``l_i = 0`` (nothing allowed) gets zeros and −inf.
    As the engine's NumPy steps: ``1 / l_i`` once, then a product; the log, then the sum."""
    g, n, ev = out.shape
    for r in range(n):
        for h in range(g):
            row = r * g + h
            l = l_i[row]
            if l > 0:
                inv = np.float32(1.0) / l
                for c in range(ev):
                    out[h, r, c] = acc[row, c] * inv
                if want_lse:
                    lse[h, r] = m_i[row] + np.log(l)
            else:
                for c in range(ev):
                    out[h, r, c] = 0.0
                if want_lse:
                    lse[h, r] = -np.inf


# ---------------------------------------------------------------------------------------------- a model's rows
# The decoder's row-wise passes between its matmuls (qkv.models.llama), each NumPy's passes in one, without the
# GIL: two workers running NumPy's short passes at once handed the lock to and fro at every one of them.
@njit(**_OPTS)
def _sum_squares(row):
    """Σ row[c]² in float64 (reassociated: vectorized)."""
    t = 0.0
    for c in range(row.shape[0]):
        x = np.float64(row[c])
        t += x * x
    return t


@njit(**_EXACT)
def rms_norm_rows(x, weight, eps, out):
    """RMSNorm of each row of x (n, D) into out (n, D): ``x · (1 / √(mean(x²) + eps)) · weight`` — the factor
    ``1 / √(mean(x²) + eps)`` in float64, rounded once (NumPy's passes, :func:`qkv.models._rowwise.rms_norm`,
    round Σ x² and each step after it in float32, where x² may overflow), then its two products as NumPy's."""
    n, d = x.shape
    for r in range(n):
        inv = np.float32(1.0 / np.sqrt(_sum_squares(x[r]) / d + eps))
        for c in range(d):
            out[r, c] = (x[r, c] * inv) * weight[c]


@njit(**_EXACT)
def rope_rows(x, heads, e, cos, sin):
    """RoPE ("neox" pairs i, i + e/2) in place on the first ``heads`` heads of each row of x (n, ≥ heads·e):
    ``a' = a·cos − b·sin``, ``b' = b·cos + a·sin`` with cos, sin (n, e/2) — bit for bit
    :func:`qkv.models._rowwise.rope_neox_`'s NumPy passes (each product rounded, then the sum: no fused
    multiply-add). (Each half a slice, indexed from 0: an index numba cannot prove non-negative keeps its
    wrap-around test, and the loop is not vectorized.)"""
    half = e // 2
    for r in range(x.shape[0]):
        row, c, s = x[r], cos[r], sin[r]
        for h in range(heads):
            a, b = row[h * e:h * e + half], row[h * e + half:h * e + e]
            for i in range(half):
                ai, bi = a[i], b[i]
                a[i] = ai * c[i] - bi * s[i]
                b[i] = bi * c[i] + ai * s[i]


@njit(**_OPTS)
def col_extents(x, edges, out):
    """``out[k]`` = max |x[:, edges[k]:edges[k + 1]]| of x (n, W) for each range of columns; NaN where the range
    holds a NaN or ±inf (their product by 0 is NaN: summed, it marks them without a branch). Two loops over
    each row's range, each vectorized (one loop with both reductions was not: 1.3 against 0.07 µs a row)."""
    for k in range(edges.shape[0] - 1):
        m = _ZERO
        bad = _ZERO
        for r in range(x.shape[0]):
            seg = x[r, edges[k]:edges[k + 1]]                     # indexed from 0: vectorized (see rope_rows)
            for c in range(seg.shape[0]):
                m = _maxf(m, abs(seg[c]))
            for c in range(seg.shape[0]):
                bad += seg[c] * _ZERO
        out[k] = np.float64(m) if bad == _ZERO else np.nan
