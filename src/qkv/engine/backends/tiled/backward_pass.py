"""The backward pass (FlashAttention-2): the gradients block by block, ``P`` recomputed from the saved lse.

With ``D_i = rowsum(dO ∘ O)`` per query row (prepared once per head, with ``Q·scale``, ``dO`` and ``−lse``, by
:func:`qkv.backends.tiled.backend.backward`), each block of queries × keys recomputes ``P = exp(S' − lse)`` —
``S'`` the modded, masked scores, by the same scorer as the forward (:mod:`qkv.backends.tiled.scoring`) — and
adds ``dV_j += Pᵀ·dO``, ``dP = dO·V_jᵀ``, ``dS' = P ∘ (dP − D)``, ``dS = dS' ∘ ∂S'/∂S`` (the score mod's
derivative: softcap ``1 − tanh²``, ALiBi 1, a custom mod's ``grad``), ``dK_j += dSᵀ·Q·scale``,
``dQ += dS·K_j`` (× scale at the end); ``d sink_h = −Σ_i exp(sink_h − lse_i)·D_i``. Key blocks are the
parallel unit — their ``dK``, ``dV`` belong to one worker — and each walks the query blocks it needs
(:meth:`qkv.backends.tiled.plan._Problem.backward_blocks`: a block mask planned per key block and query chunk
as in the forward); ``dQ`` is summed from per-task partials.

Two strategies per key block: where the scores are plain (no mod, no mask but the causal one) and the fused
kernels and the provider's C sgemm are there, each head's blocks in one compiled loop
(:func:`qkv.compute._jit.plain_backward_rows`: five products, the three accumulations by the GEMMs' beta; a causal
block across the diagonal split down to squares of ``diagonal_min_plain``) — ``backward.plain_loop``; else the
Python loop of blocks (``backward.blocks``), a block's mod, causal mask, shift and exp in one fused pass where
the mod needs no derivative (``backward.fused_exp``), through the mod's derivative otherwise
(``backward.mod_grad``), or through its vector-Jacobian product where it has one (``backward.mod_vjp``:
``dS = vjp(S, dS')``, e.g. a torch mod of :mod:`qkv.torch` whose captured tensors take gradients).

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width;
Bq a block's query rows, bk its keys.
"""
from __future__ import annotations

import numpy as np

from qkv.compute import kernels as _kernels
from qkv.compute import paths as _paths
from qkv.compute.gemm import exp as _exp, matmul as _mm  # matmuls and block exps by the runtime's provider (qkv.gemm)
from qkv.compute.kernels import NO_MASK as _NO_MASK
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled.plan import _plain_backward_plan
from qkv.engine.backends.tiled.scoring import _Scorer, _cached, _scratch

_R = _paths.register
B_PLAIN = _R("backward.plain_loop", "a head's plain blocks of a key block in one compiled loop")
B_BLOCKS = _R("backward.blocks", "the Python loop of backward blocks (P recomputed, five products)")
B_FUSED = _R("backward.fused_exp", "a backward block's mod, mask, shift and exp left to one fused pass")
B_MOD_GRAD = _R("backward.mod_grad", "a backward block through a score mod's derivative")
B_MOD_VJP = _R("backward.mod_vjp", "a backward block through a score mod's vector-Jacobian product")
B_SINKS = _R("backward.sinks", "the sinks' gradient")
del _R


def _prepare(P, grad_out, out, lse):
    """Per query head, what every key block reads: ``(Q·scale, dO, −lse, D)`` with ``D_i = rowsum(dO ∘ O)``
    ((L, E), (L, Ev), (L,), (L,); −inf where a row attends to nothing, so that its P is 0); and the sinks'
    gradient ``d sink_h = −Σ_i exp(sink_h − lse_i)·D_i`` (None without sinks)."""
    out = np.broadcast_to(out, P.lead + (P.L, P.Ev))
    grad_out = np.broadcast_to(grad_out, P.lead + (P.L, P.Ev))
    prep = {}
    d_sink = None if P.sinks is None else np.zeros(P.sinks.shape, np.float64)
    if d_sink is not None:
        _paths.hit(B_SINKS)
    for idx in np.ndindex(*P.lead):
        do = np.asarray(grad_out[idx], dtype=P.cdt)
        o = np.asarray(out[idx], dtype=P.cdt)
        D = np.einsum("le,le->l", do, o)                      # D_i = rowsum(dO ∘ O)
        lse_i = np.asarray(lse[idx], dtype=P.cdt)
        lse_neg = np.where(np.isfinite(lse_i), -lse_i, -np.inf).astype(P.cdt)   # dead rows: P = 0
        prep[idx] = (P.q_rows(idx, 0, P.L), np.ascontiguousarray(do), lse_neg, D)
        if d_sink is not None:                                # d sink_h = −Σ_i exp(sink_h − lse_i)·D_i
            h = P.bh(idx)[1]
            p_sink = np.exp(P.sinks[h] - lse_i.astype(np.float64))
            d_sink[h] -= float(np.dot(np.where(np.isfinite(lse_i), p_sink, 0.0), D))
    return prep, d_sink


class _Buffers:
    """A backward task's scratch, reused block after block: the scores then ``P`` (``s``), ``dP`` then ``dS``
    (``dp``), the mod's derivative and raw scores where the mod needs them, the products' outputs."""

    __slots__ = ("s", "dp", "grad", "raw", "jit", "sums", "dv_t", "dk_t", "dq_t", "plain", "kmin")

    def __init__(self, P, block_q: int, block_k: int):
        bq, bk, dt = min(block_q, P.L), min(block_k, P.S), P.cdt
        self.s = _scratch(1, bq * bk, dt).reshape(-1)             # a block's scores, then P
        self.dp = _scratch(1, bq * bk, dt, "dp").reshape(-1)      # dP, then dS
        needs_grad = P.mod.kind in ("softcap", "alibi_softcap", "generic")
        self.grad = _scratch(1, bq * bk, dt, "grad").reshape(-1) if needs_grad else None
        self.raw = _scratch(1, bq * bk, dt, "raw").reshape(-1) if P.mod.kind == "generic" else None
        self.jit = RUNTIME.kernels.for_block(dt, bq * bk, P.limits.kernel_min)   # exp(S' − lse) in one pass (qkv.kernels)
        self.sums = np.empty(bq, dt) if self.jit is not None else None
        self.dv_t, self.dk_t, self.dq_t = np.empty((bk, P.Ev), dt), np.empty((bk, P.E), dt), np.empty((bq, P.E), dt)
        # No mod, no mask but the causal one: each head's blocks of a key block in one compiled loop
        # (qkv.compute._jit.plain_backward_rows), the same steps as _block's, the adds done by the GEMMs
        self.plain = plain_supported(P, block_q, block_k)
        self.kmin = P.limits.kernel_min


def plain_supported(P, block_q: int, block_k: int) -> bool:
    """Whether a backward task runs its heads' blocks in the compiled loop: plain scores, the fused kernels for
    its blocks and the provider's C sgemm (the run's decision and :func:`qkv.plan`'s, one function)."""
    jit = RUNTIME.kernels.for_block(P.cdt, min(block_q, P.L) * min(block_k, P.S), P.limits.kernel_min)
    return P.plain_gemm is not None and jit is not None and P.plain_scores


def strategy_reason(P, plain: bool) -> str:
    """Why a backward task takes the compiled loop (``plain``) or the Python loop of blocks."""
    if plain:
        return "plain scores (no mod, no mask but the causal one), the fused kernels and a C sgemm"
    if not P.plain_scores:
        return "a score mod, an attn_mask or a block mask: the Python loop applies them block by block"
    return "no fused kernels or no C sgemm for these blocks"


def _backward_task(P, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep):
    """dK, dV of the key blocks ``key_starts`` of one key/value head; dQ into this task's partial."""
    with np.errstate(over="ignore", invalid="ignore"):
        buf = _Buffers(P, block_q, block_k)
        kv = P.kv(q_heads[0])                                 # (K, V, …, K_T): (S, E), (S, Ev), (E+1, S)
        for j0 in key_starts:
            j1 = min(j0 + block_k, P.S)
            if buf.plain:
                _plain_key_block(P, buf, kv, kv_idx, q_heads, j0, j1, block_q, dq_part, dk, dv, prep)
            else:
                _key_block(P, buf, kv, kv_idx, q_heads, j0, j1, block_q, dq_part, dk, dv, prep)


def _plain_key_block(P, buf, kv, kv_idx, q_heads, j0, j1, block_q, dq_part, dk, dv, prep) -> None:
    """Keys j0 … j1 against every query head of the group, each head's blocks in one compiled loop
    (:func:`qkv.kernels.run_plain_backward`), dK_j and dV_j accumulated in place."""
    _paths.hit(B_PLAIN)
    K, V, _, _, K_T = kv
    dk_j, dv_j = dk[kv_idx][j0:j1], dv[kv_idx][j0:j1]
    dk_j.fill(0.0)
    dv_j.fill(0.0)
    for r, idx in enumerate(q_heads):
        qs, do, lse_neg, D = prep[idx]
        plan = _cached(("plain backward", P.is_causal, P.L, P.S, j0, j1, block_q, P.limits.diagonal_min_plain),
                       lambda: (_plain_backward_plan(P, idx, j0, j1, block_q),))[0]
        _kernels.run_plain_backward(buf.jit, P.plain_gemm, qs, do, lse_neg, D, K, K_T, V, plan, j0, j1, buf.s,
                                    buf.dp, buf.sums, dk_j, dv_j, dq_part[r])


def _key_block(P, buf, kv, kv_idx, q_heads, j0, j1, block_q, dq_part, dk, dv, prep) -> None:
    """Keys j0 … j1 against every query head of the group, block by block (:func:`_block`)."""
    _paths.hit(B_BLOCKS)
    dk_j = np.zeros((j1 - j0, P.E), P.cdt)
    dv_j = np.zeros((j1 - j0, P.Ev), P.cdt)
    for r, idx in enumerate(q_heads):
        sc = _Scorer(P, idx, prep[idx][0], 0, kv[4], P.mask2d(idx), row_col=False)
        for i0, i1, c0, c1, kind in P.backward_blocks(idx, j0, j1, block_q):
            _block(buf, kv, sc, prep[idx], i0, i1, c0, c1, kind, dk_j[c0 - j0:c1 - j0], dv_j[c0 - j0:c1 - j0],
                   dq_part[r][i0:i1])
    dk[kv_idx][j0:j1] = dk_j
    dv[kv_idx][j0:j1] = dv_j


def _block(buf, kv, sc, head, i0, i1, c0, c1, kind, dk_c, dv_c, dq_i) -> None:
    """Query rows i0 … i1 × keys c0 … c1: ``P`` recomputed, then ``dV += Pᵀ·dO``, ``dS = P ∘ (dP − D) ∘ ∂S'/∂S``,
    ``dK += dSᵀ·Q·scale``, ``dQ += dS·K`` (into ``dk_c``, ``dv_c``, ``dq_i``: the block's rows of each)."""
    K, V = kv[0], kv[1]
    qs, do, lse_neg, D = head                                # (L, E), (L, Ev), (L,), (L,)
    m, n, jit = i1 - i0, c1 - c0, buf.jit
    s = buf.s[:m * n].reshape(m, n)
    use_jit = jit is not None and s.size >= buf.kmin
    if use_jit and buf.grad is None:                         # mod, causal mask, − lse and exp: one pass
        _paths.hit(B_FUSED)
        g = None
        fk, arg, _, d, rep = sc(s, i0, i1, c0, c1, kind, fuse=True)
        _kernels.run(jit, s, buf.sums[:m], (fk, arg, lse_neg[i0:i1], d, rep))
    else:
        g = sc(s, i0, i1, c0, c1, kind, grad=None if buf.grad is None else buf.grad[:m * n].reshape(m, n),
               raw=None if buf.raw is None else buf.raw[:m * n].reshape(m, n))
        if use_jit:
            _kernels.run(jit, s, buf.sums[:m], ("exp", None, lse_neg[i0:i1], _NO_MASK, 1))
        else:
            np.add(s, lse_neg[i0:i1, None], out=s)
            _exp(s, out=s)
    p = s                                                    # P = exp(S' − lse), recomputed
    _mm(p.T, do[i0:i1], out=buf.dv_t[:n])                    # (bk, Bq) x (Bq, Ev) -> (bk, Ev)
    dv_c += buf.dv_t[:n]                                     # dV_j += Pᵀ·dO
    dp = buf.dp[:m * n].reshape(m, n)
    _mm(do[i0:i1], V[c0:c1].T, out=dp)                       # (Bq, Ev) x (Ev, bk) -> (Bq, bk): dP = dO·V_jᵀ
    if use_jit:
        _kernels.run_ds(jit, dp, p, D[i0:i1])                # dS' = P ∘ (dP − D), one pass
    else:
        np.subtract(dp, D[i0:i1, None], out=dp)
        np.multiply(dp, p, out=dp)                           # dS' = P ∘ (dP − D)
    if callable(g):                                          # dS = vjp(dS'): the mod's own product
        _paths.hit(B_MOD_VJP)
        np.copyto(dp, g(dp))
    elif g is not None:
        _paths.hit(B_MOD_GRAD)
        np.multiply(dp, g, out=dp)                           # dS = dS' ∘ ∂score_mod/∂s
    _mm(dp.T, qs[i0:i1], out=buf.dk_t[:n])                   # (bk, Bq) x (Bq, E) -> (bk, E)  (scale in qs)
    dk_c += buf.dk_t[:n]                                     # dK_j += dSᵀ·Q·scale
    _mm(dp, K[c0:c1], out=buf.dq_t[:m])                      # (Bq, bk) x (bk, E) -> (Bq, E)
    dq_i += buf.dq_t[:m]                                     # dQ += dS·K_j (× scale at the end)
