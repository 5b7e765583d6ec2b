"""The compiled forward loop of a task whose scores carry ALiBi, a softcap or both (``compose(alibi, softcap)``):
:func:`mod_rows`, :func:`qkv.compute._jit.plain_rows`' loop with the mod in its row pass. Imported by
:func:`qkv.kernels.run_mods` once :mod:`qkv.compute._jit` is (numba is then there).

Only shift-free tasks come here (``m_i = 0`` for good: a softcap bounds every score by its cap; ALiBi under a
causal mask with slopes ≥ 0 adds nothing positive), and in base 2, as the plain loop: ALiBi alone takes log₂ e
in the query rows and its slope, a softcap in its coefficients (``log₂ e · cap · tanh(y)``), so that the
exponential is 2^x (:func:`_exp2f`, clamped: ALiBi's far keys go below any exponent float32 holds).

ALiBi's bias ``slope·(j − i)`` rounds as the Python loop's (:meth:`qkv.backends.tiled.scoring._Scorer.__call__`):
beside the diagonal ``slope·(j − ρ) + slope·(ρ − i)`` with ρ between the block's keys and queries, the row term
riding in the product (``qs``' last column times ``k_t``'s row of ones), the column term added; across it the
bias itself, each element once in float64.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from qkv.compute._cblas import NO_TRANS as _NO_TRANS
from qkv.compute._jit import (_F, _ONE, _OPTS, _ZERO, _exp2f_bounded, _exp_row, _fits, _forward_layout, _gemm, _limit,
                   _tanhf)

__all__ = ["mod_rows"]

_LO2, _HI2 = _F(-127.0), _F(128.0)                          # 2^n's bits 0 and inf (see _jit._exp2f_bounded)


@njit(inline="always", **_OPTS)
def _exp2f(v):
    """2^v clamped to [−127, 128] first: 0 below (a key far behind under ALiBi), inf above; NaN stays NaN."""
    x = _LO2 if v < _LO2 else v
    x = _HI2 if x > _HI2 else x
    return _exp2f_bounded(x)


@njit(inline="always", **_OPTS)
def _exp2_f_row(row, lim, f, k, col):
    """``row[c] ← 2^f(row[c], c, k, col)`` for c < lim, 0 after; returns the row's sum — whatever the mod does
    to a score and the exponential in one pass over the row (``f`` one of the functions below, inlined)."""
    acc = _ZERO
    for c in range(lim):
        e = _exp2f(f(row[c], c, k, col))
        row[c] = e
        acc += e
    row[lim:] = _ZERO
    return acc


@njit(inline="always", **_OPTS)
def _plus_col(x, c, k, col):
    return x + col[c]                                        # ALiBi's column term (beside the diagonal)


@njit(inline="always", **_OPTS)
def _poly4(x, c, k, col):
    t = x * x                                                # the softcap's polynomial, four terms
    return (((k[3] * t + k[2]) * t + k[1]) * t + k[0]) * x


@njit(inline="always", **_OPTS)
def _poly7(x, c, k, col):
    t = x * x                                                # …seven
    return ((((((k[6] * t + k[5]) * t + k[4]) * t + k[3]) * t + k[2]) * t + k[1]) * t + k[0]) * x


@njit(inline="always", **_OPTS)
def _cap_tanh(x, c, k, col):
    return k[7] * _tanhf(x)                                  # cap·tanh


@njit(inline="always", **_OPTS)
def _f_exp2_row(row, lim, kind, k, col):
    """``row[c] ← 2^f(row[c])`` (``f`` by ``kind`` 1 or 2, as :func:`qkv.compute._jit._f_row`; ``k`` its seven
    coefficients and the cap) in one pass with its sum; four terms where the top three are 0 (three FMAs
    fewer)."""
    if kind == 2:
        return _exp2_f_row(row, lim, _cap_tanh, k, col)
    if k[4] == _ZERO and k[5] == _ZERO and k[6] == _ZERO:
        return _exp2_f_row(row, lim, _poly4, k, col)
    return _exp2_f_row(row, lim, _poly7, k, col)


@njit(inline="always", **_OPTS)
def _bias_row(row, lim, slope, j0, i):
    """``row[c] += float32(slope·(j0 + c − i))`` for c < lim: ALiBi's bias across the diagonal, in float64."""
    for c in range(lim):
        row[c] = row[c] + np.float32(slope * (j0 + c - i))


@njit(**_OPTS)
def mod_rows(sgemm, clock, clock_id, timing, qs, k_t, v, blocks, s_flat, acc, l_i, sums, col, rep, a0, kind, coef,
             cap, slope):
    """:func:`qkv.compute._jit.plain_rows` (blocks ``(r0, r1, j0, j1, d, fresh)``, ``acc``, ``l_i``, ``timing`` as there)
    for shift-free scores under a mod, in base 2: per row of a block, ``x = s + bias`` (ALiBi, where ``slope``
    — already times log₂ e when the rows carry it — is not NaN; query position ``a0 + row // rep``), then
    ``f(x)`` (``kind`` as :func:`qkv.compute._jit._f_row`: 0 none, 1 the softcap polynomial ``coef``, 2 ``cap·tanh``,
    log₂ e in ``coef`` and ``cap``), then ``p = 2^f(x)`` where the causal diagonal allows, 0 after. ``col``
    (at least the widest block's keys) holds a block's column terms."""
    E1 = k_t.shape[0]
    ev, lda, ldk, ldv, lacc, qp, kp, vp, ap, sp, ts = _forward_layout(qs, k_t, v, acc, s_flat)
    spent = flops = 0.0
    alibi = slope == slope
    k = (coef[0], coef[1], coef[2], coef[3], coef[4], coef[5], coef[6], cap)
    for b in range(blocks.shape[0]):
        r0, r1, j0, j1, d, fresh = (blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3], blocks[b, 4],
                                    blocks[b, 5])
        if not _fits(r0, r1, j0, j1, qs.shape[0], k_t.shape[1], s_flat.shape[0]) or j1 - j0 > col.shape[0]:
            raise ValueError("mod_rows: a block outside its buffers")      # the GEMM writes raw memory
        m, w = r1 - r0, j1 - j0
        first, last = a0 + r0 // rep, a0 + (r1 - 1) // rep                 # the block's query positions
        beside = alibi and (j1 - 1 <= first or j0 >= last)
        if beside:                                           # slope·(j − ρ) + slope·(ρ − i), ρ between them
            rho = j1 - 1 if j1 - 1 <= first else j0
            for r in range(m):
                qs[r0 + r, E1 - 1] = np.float32(slope * (rho - (a0 + (r0 + r) // rep)))
            for c in range(w):
                col[c] = np.float32(slope * (j0 + c - rho))
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, w, E1 if beside else E1 - 1,
                       qp + 4 * r0 * lda, lda, kp + 4 * j0, ldk, _ZERO, sp, w)     # s (+ the row term)
        s = s_flat[:m * w].reshape(m, w)
        for r in range(m):
            row = s[r]
            lim = _limit(d, r, rep, w)
            if beside and kind == 0:
                sums[r] = _exp2_f_row(row, lim, _plus_col, k, col)
                continue
            if beside:
                for c in range(lim):
                    row[c] = row[c] + col[c]
            elif alibi:
                _bias_row(row, lim, slope, j0, a0 + (r0 + r) // rep)
            sums[r] = _f_exp2_row(row, lim, kind, k, col) if kind != 0 else _exp_row(row, lim, _ZERO, _exp2f)
        for r in range(m):
            l_i[r0 + r] = sums[r] if fresh else l_i[r0 + r] + sums[r]
        spent += _gemm(sgemm, clock, clock_id, timing, ts, _NO_TRANS, _NO_TRANS, m, ev, w, sp, w,
                       vp + 4 * j0 * ldv, ldv, _ZERO if fresh else _ONE, ap + 4 * r0 * lacc, lacc)  # acc (+)= p·V
        flops += 2.0 * m * w * (E1 - 1 + ev)
    return spent, flops if timing else 0.0
