"""The forward (temporary: moved as is)."""
from __future__ import annotations

import math

import numpy as np

from ... import kernels as _kernels
from ... import paths as _paths
from ...gemm import exp as _exp, matmul as _mm  # matmuls and block exps by the runtime's provider (qkv.gemm)
from ...kernels import KERNELS as _KERNELS, NO_MASK as _NO_MASK
from ...merge import merge_partials
from .plan import _LOG_HEADROOM, _band_groups, _first_rows, _plain_plan, _task_blocks
from .scoring import _Scorer, _apply_poly, _cached, _scratch

_LOG2E = 1.4426950408889634                                 # log₂ e: 2^(s·log₂ e) = e^s

_R = _paths.register
F_PLAIN = _R("forward.plain_loop", "a task's plain blocks in one compiled loop, shift-free, base 2")
F_PLAIN_LAZY = _R("forward.plain_loop_lazy", "a task's plain blocks in one compiled loop, lazy rescaling")
F_BANDS = _R("forward.bands", "a run of a block mask's bands batched into one call per step")
F_SHIFT_FREE = _R("forward.shift_free", "a block with no running max (scores provably bounded)")
F_ALIBI_FOLD = _R("forward.alibi_fold", "ALiBi's column term folded into V and the row sums (shift-free)")
F_LAZY = _R("forward.lazy", "a block exponentiated against the running max it found (lazy rescaling)")
F_MAX_PASS = _R("forward.max_pass", "a block with the max pass: the running max raised, acc rescaled")
F_SINKS = _R("forward.sinks", "sinks merged into a task's rows as one more key without a value")
F_WEIGHTS = _R("forward.weights", "the weights' second pass, exp(s - lse) stored")
F_GROUP = _R("forward.grouped_heads", "the query heads sharing a key/value head in one task, rows interleaved")
F_DROPOUT = _R("forward.dropout", "a block's keep-mask drawn and applied")
F_NUMPY_BLOCK = _R("forward.numpy_block", "a block's exp and row sums by NumPy's passes (no fused kernel)")
del _R


def _dropout_rng(seed, lead, idx, i0):
    flat = int(np.ravel_multi_index(idx, lead)) if lead else 0
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, flat, i0])))


# ---------------------------------------------------------------------------------------------- forward
def _forward_task(P, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed, keys=None):
    """One (head, query block): the online softmax over the key blocks; writes out/lse/weights rows.
    ``keys=(k0, k1)`` (split-K): only the key blocks starting in k0 … k1, a partial result without sinks."""
    with np.errstate(over="ignore", invalid="ignore"):      # overflow is detected and the block redone
        _forward_rows(P, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed, keys)


def _forward_rows(P, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed, keys=None):
    K, V, k_norm, v_max, K_T = P.kv(idx)                     # (S, E), (S, Ev), (E+1, S)
    E, Ev = P.E, P.Ev
    mask2d = P.mask2d(idx)
    g = P.group                                              # rows per position: g interleaved query heads
    Bq = (i1 - i0) * g
    qs = np.empty((Bq, E + 1), P.cdt)                        # [Q·scale, row term]: scale folded in once
    qs[:, E] = 0.0
    if mask2d is None and P.bm is None:                      # the blocks depend on the shapes alone: made once
        blocks, widest, tallest = _cached(("blocks", P.is_causal, i0, i1, P.S, block_k, g, keys, P.limits.diagonal_min),
                                          lambda: _task_blocks(P, idx, i0, i1, None, block_k, g, keys))
    else:
        blocks, widest, tallest = _task_blocks(P, idx, i0, i1, mask2d, block_k, g, keys)
    # the fused block kernels (qkv.kernels: mask, softcap, shift, exp and row sums in one pass), where in use
    jit = _KERNELS.for_block(P.cdt, tallest * widest, P.limits.kernel_min)
    sc = _Scorer(P, idx, qs, i0, K_T, mask2d, row_col=True)
    q_norm = P.q_norm_group(idx, i0, i1)                    # max |Q·scale| of the rows, before they are scaled
    # How large a block's Σ exp(s − m_i) may grow before acc could overflow (float32 and float64 alike).
    log_room = _LOG_HEADROOM - math.log(P.S) - math.log1p(v_max)
    # Shift-free: no (modified) score can leave the bounds of P.shift_free, so m_i = 0 for good.
    shift_free = P.shift_free(q_norm * k_norm * P.mod.qdiv, log_room, sc.slope)
    plain = shift_free and sc.kind == "none"                 # scores within ±SHIFT_FREE_BOUND, unmodified
    # Base 2: log₂ e folded into the query rows' scale (one rounding), so that a plain block's exponential is
    # 2^s — e^score with a third less work in the kernel (qkv.kernels.run, base2). Where every block is "full"
    # or "causal" and nothing else reads the scores (no weights' second pass, no dropout, no mask or bands),
    # and shift-free: the lazy blocks' larger scores (up to ~100 on the tests' inputs) made the backward's P,
    # recomputed from e^s and this lse, off from the forward's by the two matmuls' rounding (1.7–4× the
    # gradients' error against float64); within ±30 the error is as before.
    # nothing but products, exponentials and row sums (no mod, no mask but the causal one, nothing else reading
    # the scores), with the kernels
    bare = jit is not None and P.plain_scores and weights is None and dropout_p == 0
    base2 = bare and shift_free
    P.q_rows_group(idx, i0, i1, qs[:, :E], _LOG2E if base2 else 1.0)
    k_poly = sc.use_poly(q_norm * k_norm)                    # softcap: |s/cap| ≤ q_norm·k_norm (qs holds 1/cap)
    if k_poly != 1.0:
        qs[:, :E] *= P.cdt.type(k_poly)
    # Otherwise lazy rescaling: m_i (folded into the matmul as qs[:, E] = −m_i) is a max some block
    # attained; a block is exponentiated against it as is, and only when its row sums grow past
    # exp(LAZY_BOUND) (or a row has seen nothing yet) is it redone with a max pass and a rescale.
    lazy = not shift_free and dropout_p == 0 and log_room > P.limits.lazy_bound + 1
    if not shift_free and sc.kind in ("alibi", "alibi_softcap") and sc.slope is not None:
        # the blocks with the largest bias first (the diagonal, for a causal ALiBi): later ones then rarely
        # raise the running max, where in key order every block of a steep head would be redone.
        sl = sc.slope
        blocks = sorted(blocks, key=lambda b: -(sl * (b[3] - 1 - (i0 + b[0])) if sl >= 0
                                                else sl * (b[2] - (i0 + b[1] - 1))))
    row_limit = math.exp(P.limits.lazy_bound)
    # ALiBi's column term folded into V: only shift-free (m_i = 0 for good), where a factor e^{c_j} ≤ 1
    # cannot hide a row's max from a running-max update
    fold_col = shift_free and sc.kind == "alibi" and sc.slope is not None and sc.slope >= 0
    plan = None
    if bare and P.plain_gemm is not None:
        # the whole loop compiled, the GEMMs by the provider's C function — the same steps as below, without the
        # Python between them: 2^s where shift-free (qkv._jit.plain_rows), else the lazy rescaling
        # (qkv._jit.plain_lazy_rows); with no per-block cost of its own, a causal diagonal in smaller squares
        # (less computed for nothing). The plan depends on the shapes alone (no mask, no mod): made once, kept.
        pbk = P.plain_block_k or block_k
        plan, room = _cached(("plain", P.is_causal, i0, i1, P.S, pbk, g, keys, P.limits.diagonal_min_plain),
                             lambda: _plain_plan(P, i0, i1, pbk, g, keys))
    # a block's scores, then probabilities (the compiled loop's: as many as its largest block)
    s_flat = _scratch(1, tallest * widest if plan is None else room, P.cdt).reshape(-1)
    ones = np.ones(widest, P.cdt)
    tmp = np.empty((Bq, Ev), P.cdt) if plan is None else None
    v_buf = np.empty((widest, Ev), P.cdt) if fold_col else None
    l_blk = np.empty(Bq, P.cdt)
    acc = np.zeros((Bq, Ev), P.cdt)                          # Σ p·v per row
    l_i = np.zeros(Bq, P.cdt)                                # Σ p per row (before dropout)
    m_i = np.zeros(Bq, P.cdt)                                # running max (the shift actually subtracted)
    seen = np.full(Bq, shift_free)                           # m_i is a max some block attained
    gen = _dropout_rng(seed, P.lead, idx, i0) if dropout_p > 0 else None
    keep_scale = 0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)
    added = []                                               # (r0, r1) of the shift-free blocks accumulated
    steps = blocks
    if g > 1:
        _paths.hit(F_GROUP)
    if plan is not None:
        _paths.hit(F_PLAIN if shift_free else F_PLAIN_LAZY)
        if shift_free:
            _kernels.run_plain(jit, P.plain_gemm, qs, K_T, V, plan, s_flat, acc, l_i, l_blk, sc.zeros, g)
        else:
            _kernels.run_plain_lazy(jit, P.plain_gemm, qs, K_T, V, plan, s_flat, acc, l_i, m_i, seen, l_blk, sc.zeros, g,
                             lazy, row_limit)
        steps = ()
    if (shift_free and gen is None and P.bm is not None and sc.kind in ("none", "alibi", "softcap", "alibi_softcap")
            and (sc.kind == "none" or sc.slope is not None or sc.cap is not None)):
        steps = _band_groups(P, blocks, i0, sc.slope if sc.kind in ("alibi", "alibi_softcap") else None,
                             P.limits.band_group_scores)
    for step in steps:
        if step[0] == "bands":                               # a run of bands, batched
            _paths.hit(F_BANDS)
            _, r0, nb, h, j0, w, pattern = step
            _bands(P, qs, K_T, V, r0, nb, h, j0, w, pattern, sc, acc, l_i, ones)
            added.append((r0, r0 + nb * h))                  # its rows accumulated (a later block adds to them)
            continue
        r0, r1, j0, j1, kind = step
        rs = slice(r0 * g, r1 * g)                           # the block's rows (all, but on the diagonal)
        w = j1 - j0
        s = s_flat[:(r1 - r0) * g * w].reshape((r1 - r0) * g, w)
        a0, a1 = i0 + r0, i0 + r1                            # absolute query rows, for the masks
        summed = False                                        # the kernel wrote the row sums into l_blk
        if shift_free:
            _paths.hit(F_SHIFT_FREE)
            # nothing accumulated in these rows yet (a Python test on the plan, where `l_i[rs].any()` cost
            # ~16 µs a block)
            fresh = _first_rows(added, r0, r1)
            # (Bq, E) x (E, bk) -> (Bq, bk), modded, masked; p = exp(s − 0)
            plan = sc(s, a0, a1, j0, j1, kind, fold_col=fold_col, fuse=jit is not None)
            if plan is not None:
                # no mod and nothing masked but the causal diagonal (the kernel's limit): every score is
                # within ±SHIFT_FREE_BOUND, so the exponential needs no clamps
                _kernels.run(jit, s, l_blk[rs], plan, bounded=plain and kind in ("full", "causal"), base2=base2)
                summed = True
            else:
                _paths.hit(F_NUMPY_BLOCK)
                _exp(s, out=s)
            if sc.col_exp is not None:                       # ALiBi's column factor e^{c_j}: into V, row sums
                _paths.hit(F_ALIBI_FOLD)
                Vb = v_buf[:w]
                np.multiply(V[j0:j1], sc.col_exp[:, None], out=Vb)
                lb = l_blk[rs]
                _mm(s, sc.col_exp, out=lb)
                l_i[rs] += lb
                if gen is not None:
                    keep = gen.random(s.shape, dtype=np.float32) >= dropout_p
                    np.multiply(s, keep, out=s)
                    s *= keep_scale
                t = tmp[rs]
                _mm(s, Vb, out=t)
                acc[rs] += t
                continue
        else:
            # lazy where every row of this block has a max already (these rows, not the whole task's: a causal
            # diagonal's lower rows first see keys in a later block than the upper ones — measured on SmolLM2's
            # prefill, 512 rows, 7 blocks: a task-wide test sent ~90 % of the scores to the max pass)
            lazy_now = lazy and seen[rs].all()
            plan = sc(s, a0, a1, j0, j1, kind, m=m_i[rs], fuse=jit is not None)   # s − m_i
            if lazy_now:
                lb = l_blk[rs]
                if plan is not None:
                    _kernels.run(jit, s, lb, plan)                  # p = exp(s − m_i) and row sums, one pass
                else:
                    _paths.hit(F_NUMPY_BLOCK)
                    _exp(s, out=s)                            # p = exp(s − m_i), m_i unchanged
                    _mm(s, ones[:w], out=lb)                 # (Bq, bk) x (bk,) -> (Bq,) row sums
                if np.all(lb <= row_limit):                  # (NaN/inf fail too)
                    _paths.hit(F_LAZY)
                    t = tmp[rs]
                    _mm(s, V[j0:j1], out=t)                  # (Bq, bk) x (bk, Ev) -> (Bq, Ev)
                    acc[rs] += t
                    l_i[rs] += lb
                    continue
                # grew too much: redo with a max pass
                plan = sc(s, a0, a1, j0, j1, kind, m=m_i[rs], fuse=jit is not None)
            # -- update m_i: raise it to this block's max; rescale what was accumulated under the old
            _paths.hit(F_MAX_PASS)
            seen_r = seen[rs]
            fresh = not seen_r.any()                         # a row without a max has acc = l_i = 0 (its
            #                                                  blocks so far allowed no key): nothing to rescale
            if plan is not None:                             # max, shift, exp and row sums in the kernel
                shift = np.empty(len(seen_r), P.cdt)
                hit = np.empty(len(seen_r), np.bool_)
                _kernels.run_max(jit, s, l_blk[rs], plan, seen_r, shift, hit)
                summed = True
            else:
                _paths.hit(F_NUMPY_BLOCK)
                m_blk = np.maximum.reduce(s, axis=1)         # relative to the current m_i; −inf if all masked
                hit = np.isfinite(m_blk)
                shift = np.where(seen_r, np.maximum(m_blk, 0.0), np.where(hit, m_blk, 0.0)).astype(P.cdt)
                np.subtract(s, shift[:, None], out=s)
                _exp(s, out=s)                                # p = exp(s − m_i)
            if not fresh:
                alpha = np.where(seen_r, np.exp(-shift), 0.0)    # exp(m_old − m_new); nothing yet: 0
                acc[rs] *= alpha[:, None]
                l_i[rs] *= alpha
            m_i[rs] += shift
            seen[rs] |= hit
        lb = l_blk[rs]
        if not summed:
            _mm(s, ones[:w], out=lb)                         # (Bq, bk) x (bk,) -> (Bq,) row sums
        if fresh:                                            # the rows' first block: written, not added
            l_i[rs] = lb
        else:
            l_i[rs] += lb                                    # the softmax denominator ignores dropout
        if gen is not None:
            _paths.hit(F_DROPOUT)
            keep = gen.random(s.shape, dtype=np.float32) >= dropout_p
            np.multiply(s, keep, out=s)
            s *= keep_scale
        if fresh:
            _mm(s, V[j0:j1], out=acc[rs])                    # (Bq, bk) x (bk, Ev) -> (Bq, Ev), into acc
        else:
            t = tmp[rs]
            _mm(s, V[j0:j1], out=t)                          # (Bq, bk) x (bk, Ev) -> (Bq, Ev)
            acc[rs] += t
    nz = l_i > 0                                             # l_i = 0: a query that may attend to nothing
    inv = np.divide(1.0, l_i, out=np.zeros_like(l_i), where=nz)
    sink = P.sinks is not None and keys is None
    rows_out = None                                          # grouped rows: scaled into each head's output
    if g == 1:                                               # straight into the output (unless a sink is
        rows_out = np.empty_like(acc) if sink else out[idx][i0:i1]   # merged in first): one pass
        np.multiply(acc, inv[:, None], out=rows_out)
    row_lse = None
    if lse is not None or P.sinks is not None or keys is not None or weights is not None:
        log_l = np.log(l_i, out=np.full_like(l_i, -np.inf), where=nz)
        row_lse = np.where(nz, m_i + log_l, -np.inf).astype(P.cdt, copy=False)
    if sink:
        _paths.hit(F_SINKS)
        # The sink is one more key, with no value: a partial result out = 0, lse = sink, merged in.
        rows_out, row_lse = merge_partials(rows_out, row_lse, np.zeros_like(rows_out),
                                           np.full_like(row_lse, P.sinks[sc.sh]))
    if g == 1:
        if sink:
            out[idx][i0:i1] = rows_out
        if lse is not None:
            lse[idx][i0:i1] = row_lse
    else:                                                    # back to each head of the group
        for h in range(g):
            head = idx[:-1] + (idx[-1] + h,)
            np.multiply(acc[h::g], inv[h::g, None], out=out[head][i0:i1])
            if lse is not None:
                lse[head][i0:i1] = row_lse[h::g]
    if weights is not None:                                  # second pass: p = exp(s − lse), stored
        _paths.hit(F_WEIGHTS)
        gen = _dropout_rng(seed, P.lead, idx, i0) if dropout_p > 0 else None
        sub = np.where(np.isfinite(row_lse), row_lse, np.inf)[:, None]   # fully masked rows: exp(−inf) = 0
        w_rows = weights[idx]
        for r0, r1, j0, j1, kind in blocks:
            w = j1 - j0
            s = s_flat[:(r1 - r0) * w].reshape(r1 - r0, w)
            sc(s, i0 + r0, i0 + r1, j0, j1, kind)
            np.subtract(s, sub[r0:r1], out=s)
            _exp(s, out=s)
            if gen is not None:
                keep = gen.random(s.shape, dtype=np.float32) >= dropout_p
                np.multiply(s, keep, out=s)
                s *= keep_scale
            w_rows[i0 + r0:i0 + r1, j0:j1] = s


def _bands(P, qs, K_T, V, r0, nb, h, j0, w, pattern, sc, acc, l_i, ones) -> None:
    """``nb`` bands of h query rows (from task row r0), band b against keys j0 + b·h … + w, shift-free:
    scores, pattern, softcap, exp, row sums and P·V each one call over all bands (strided views)."""
    E, Ev, it = P.E, P.Ev, P.cdt.itemsize
    ast = np.lib.stride_tricks.as_strided
    Qb = qs[r0:r0 + nb * h, :E].reshape(nb, h, E)                          # (nb, h, E)
    Kb = ast(K_T[:E, j0:], shape=(nb, E, w), strides=(h * it, K_T.strides[0], it), writeable=False)
    Vb = ast(V[j0:], shape=(nb, w, Ev), strides=(h * V.strides[0], V.strides[0], it), writeable=False)
    s = _scratch(1, nb * h * w, P.cdt).reshape(nb, h, w)
    _mm(Qb, Kb, out=s)                                                      # (nb, h, E) x (nb, E, w)
    bias, mask = pattern
    jit = _KERNELS.for_block(P.cdt, s.size, P.limits.kernel_min)
    pat = mask
    if jit is not None and mask is None and bias is not None and sc.cap is None:
        pat, bias = bias, None                                              # ALiBi's bias and mask, in the kernel
    if bias is not None:
        np.add(s, bias, out=s)                                              # ALiBi's bias (and the mask)
    if jit is not None and pat is not None and pat.dtype == P.cdt and pat.flags.c_contiguous:
        # softcap, the mask, exp and row sums in one pass (qkv.kernels)
        kind, arg = ("poly", sc.poly_coef) if sc.poly is not None else ("tanh", sc.cap) if sc.cap is not None \
            else ("exp", None)
        lb = np.empty(nb * h, P.cdt)
        _kernels.run_bands(jit, s, lb, kind, arg, pat)
        l_i[r0:r0 + nb * h] += lb
        t = _mm(s, Vb)                                                      # (nb, h, Ev)
        acc[r0:r0 + nb * h] += t.reshape(-1, Ev)
        return
    if sc.poly is not None:
        _apply_poly(s, sc.poly)
    elif sc.cap is not None:
        np.tanh(s, out=s)
        np.multiply(s, sc.cap, out=s)
    if mask is not None:
        np.add(s, mask, out=s)                                              # −inf where masked
    if jit is not None:                                                     # exp and row sums, one pass
        lb = np.empty(nb * h, P.cdt)
        _kernels.run(jit, s, lb, ("exp", None, sc.zeros[r0:r0 + nb * h], _NO_MASK, 1))
    else:
        _paths.hit(F_NUMPY_BLOCK)
        _exp(s, out=s)
        lb = _mm(s, ones[:w])                                               # (nb, h) row sums
    l_i[r0:r0 + nb * h] += lb.reshape(-1)
    t = _mm(s, Vb)                                                          # (nb, h, Ev)
    acc[r0:r0 + nb * h] += t.reshape(-1, Ev)
