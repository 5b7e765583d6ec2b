"""The backward (temporary)."""
from __future__ import annotations

import numpy as np

from ... import kernels as _kernels
from ... import paths as _paths
from ...gemm import exp as _exp, matmul as _mm
from ...kernels import KERNELS as _KERNELS, NO_MASK as _NO_MASK
from .plan import _plain_backward_plan
from .scoring import _Scorer, _cached, _scratch

_R = _paths.register
B_PLAIN = _R("backward.plain_loop", "a head's plain blocks of a key block in one compiled loop")
B_BLOCKS = _R("backward.blocks", "the Python loop of backward blocks (P recomputed, five products)")
B_FUSED = _R("backward.fused_exp", "a backward block's mod, mask, shift and exp left to one fused pass")
B_MOD_GRAD = _R("backward.mod_grad", "a backward block through a score mod's derivative")
B_SINKS = _R("backward.sinks", "the sinks' gradient")
del _R


# ---------------------------------------------------------------------------------------------- backward
def _backward_task(P, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep):
    """dK, dV of the key blocks ``key_starts`` of one key/value head; dQ into this task's partial."""
    with np.errstate(over="ignore", invalid="ignore"):
        _backward_blocks(P, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep)


def _backward_blocks(P, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep):
    K, V, _, _, K_T = P.kv(q_heads[0])
    E, Ev = P.E, P.Ev
    bq, bk = min(block_q, P.L), min(block_k, P.S)
    s_buf = _scratch(1, bq * bk, P.cdt).reshape(-1)          # a block's scores, then P
    dp_buf = _scratch(1, bq * bk, P.cdt, "dp").reshape(-1)   # dP, then dS
    needs_grad = P.mod.kind in ("softcap", "alibi_softcap", "generic")
    g_buf = _scratch(1, bq * bk, P.cdt, "grad").reshape(-1) if needs_grad else None
    raw_buf = _scratch(1, bq * bk, P.cdt, "raw").reshape(-1) if P.mod.kind == "generic" else None
    jit = _KERNELS.for_block(P.cdt, bq * bk, P.limits.kernel_min)                   # exp(S' − lse) in one pass (qkv.kernels)
    sums = np.empty(bq, P.cdt) if jit is not None else None
    dv_t, dk_t, dq_t = np.empty((bk, Ev), P.cdt), np.empty((bk, E), P.cdt), np.empty((bq, E), P.cdt)
    # No mod, no mask but the causal one: each head's blocks of a key block in one compiled loop
    # (qkv._jit.plain_backward_rows), the same steps as below, the adds done by the GEMMs
    plain = P.plain_gemm is not None and jit is not None and P.plain_scores
    kmin = P.limits.kernel_min
    for j0 in key_starts:
        j1 = min(j0 + block_k, P.S)
        n_j = j1 - j0
        if plain:
            _paths.hit(B_PLAIN)
            dk_j, dv_j = dk[kv_idx][j0:j1], dv[kv_idx][j0:j1]
            dk_j.fill(0.0)
            dv_j.fill(0.0)
            for r, idx in enumerate(q_heads):
                qs, do, lse_neg, D = prep[idx]
                plan = _cached(("plain backward", P.is_causal, P.L, P.S, j0, j1, block_q, P.limits.diagonal_min_plain),
                               lambda: (_plain_backward_plan(P, idx, j0, j1, block_q),))[0]
                _kernels.run_plain_backward(jit, P.plain_gemm, qs, do, lse_neg, D, K, K_T, V, plan, j0, j1, s_buf, dp_buf,
                                     sums, dk_j, dv_j, dq_part[r])
            continue
        _paths.hit(B_BLOCKS)
        dk_j = np.zeros((n_j, E), P.cdt)
        dv_j = np.zeros((n_j, Ev), P.cdt)
        for r, idx in enumerate(q_heads):
            qs, do, lse_neg, D = prep[idx]                   # (L, E), (L, Ev), (L,), (L,)
            sc = _Scorer(P, idx, qs, 0, K_T, P.mask2d(idx), row_col=False)
            for i0, i1, c0, c1, kind in P.backward_blocks(idx, j0, j1, block_q):
                m, n = i1 - i0, c1 - c0
                s = s_buf[:m * n].reshape(m, n)
                use_jit = jit is not None and s.size >= kmin
                if use_jit and g_buf is None:                  # mod, causal mask, − lse and exp: one pass
                    _paths.hit(B_FUSED)
                    g = None
                    fk, arg, _, d, rep = sc(s, i0, i1, c0, c1, kind, fuse=True)
                    _kernels.run(jit, s, sums[:m], (fk, arg, lse_neg[i0:i1], d, rep))
                else:
                    g = sc(s, i0, i1, c0, c1, kind,
                           grad=None if g_buf is None else g_buf[:m * n].reshape(m, n),
                           raw=None if raw_buf is None else raw_buf[:m * n].reshape(m, n))
                    if use_jit:
                        _kernels.run(jit, s, sums[:m], ("exp", None, lse_neg[i0:i1], _NO_MASK, 1))
                    else:
                        np.add(s, lse_neg[i0:i1, None], out=s)
                        _exp(s, out=s)
                p = s                                          # P = exp(S' − lse), recomputed
                o = c0 - j0
                _mm(p.T, do[i0:i1], out=dv_t[:n])             # (bk, Bq) x (Bq, Ev) -> (bk, Ev)
                dv_j[o:o + n] += dv_t[:n]
                dp = dp_buf[:m * n].reshape(m, n)
                _mm(do[i0:i1], V[c0:c1].T, out=dp)           # (Bq, Ev) x (Ev, bk) -> (Bq, bk)
                if use_jit:
                    _kernels.run_ds(jit, dp, p, D[i0:i1])     # dS' = P ∘ (dP − D), one pass
                else:
                    np.subtract(dp, D[i0:i1, None], out=dp)
                    np.multiply(dp, p, out=dp)                # dS' = P ∘ (dP − D)
                if g is not None:
                    _paths.hit(B_MOD_GRAD)
                    np.multiply(dp, g, out=dp)                # dS = dS' ∘ ∂score_mod/∂s
                _mm(dp.T, qs[i0:i1], out=dk_t[:n])           # (bk, Bq) x (Bq, E) -> (bk, E)  (scale in qs)
                dk_j[o:o + n] += dk_t[:n]
                _mm(dp, K[c0:c1], out=dq_t[:m])              # (Bq, bk) x (bk, E) -> (Bq, E)
                dq_part[r][i0:i1] += dq_t[:m]
        dk[kv_idx][j0:j1] = dk_j
        dv[kv_idx][j0:j1] = dv_j
