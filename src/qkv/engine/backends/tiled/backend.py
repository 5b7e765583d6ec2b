"""The tiled backend's entry points: :func:`forward`, :func:`backward` and :class:`TiledBackend`.

A call builds the problem (:class:`qkv.backends.tiled.plan._Problem`, which reads the limits in force once),
cuts it into tasks (:mod:`qkv.backends.tiled.setup`, the same function :func:`qkv.plan` asks) and runs them on
the runtime's pool (:mod:`qkv.backends.runtime`: :func:`get_num_threads` workers, each pinned to its own CPU,
BLAS limited to one thread each while they run; NumPy releases the GIL inside its matmuls and ufunc loops).
With ``QKV_CHECK_PLANS=1`` the call's plan (:mod:`qkv.backends.tiled.schedule`) is proven against the mask first
(:mod:`qkv.backends.tiled.proof`).
"""
from __future__ import annotations

import os

import numpy as np

from qkv import _checks
from qkv.core import shapes
from qkv.engine.backends.base import Backend
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled import backward_pass as _bp, forward_pass as _fp, split as _split
from qkv.engine.backends.tiled.plan import _Problem
from qkv.engine.backends.tiled.setup import backward_setup, forward_setup
from qkv.engine.backends.tiled.thresholds import current_limits

_sum_to_shape = shapes.sum_to_shape


def forward(query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale, enable_gqa=False,
            rng=None, return_weights=False, return_lse=False, threads=None, block_q=None, block_k=None,
            score_mod=None, block_mask=None, sink_logits=None):
    """The tiled forward on validated arrays; returns ``(output, weights|None, lse|None)``.

    ``output`` (..., Hq, L, Ev) in the input dtype; ``lse`` (..., Hq, L) in the compute dtype (float32 for
    float16/32 inputs), −inf on fully masked rows; ``weights`` (..., Hq, L, S) only when asked for.
    ``score_mod``, ``block_mask``, ``sink_logits``: as :func:`qkv.flex_attention` (see the package doc).
    ``block_q``/``block_k`` override the block sizes (tests use small ones to hit block boundaries); with a
    block mask they are rounded to multiples of its BLOCK_SIZE.
    """
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod, block_mask, sink_logits)
    setup = forward_setup(P, block_q, block_k, threads, dropout_p, return_weights)
    P = setup.problem                                         # (as cut: what the tasks read)
    if checks_plans():                                        # QKV_CHECK_PLANS=1: the plan proven first
        from qkv.engine.backends.tiled import proof, schedule
        proof.check(schedule.forward_plan_of(setup, dropout_p, return_weights))
    out = np.empty(P.lead + (P.L, P.Ev), P.cdt)
    lse = np.empty(P.lead + (P.L,), P.cdt) if return_lse else None
    if return_weights:                                       # the one array here whose size is L·S
        _checks.fits_scores(P.lead + (P.L, P.S), P.cdt.itemsize, 1, "the weights", _checks.FEWER_WEIGHTS)
    weights = np.zeros(P.lead + (P.L, P.S), P.cdt) if return_weights else None
    if dropout_p > 0 and rng is None:
        rng = np.random.default_rng()
    seed = int(rng.integers(2**63)) if dropout_p > 0 else 0
    if setup.splits > 1:
        return _split._forward_split(P, setup.parts, setup.splits, setup.bk, setup.threads, query.dtype, return_lse)
    tasks = [(P, idx, i0, i1, setup.bk, out, lse, weights, dropout_p, seed) for idx, i0, i1, _ in setup.parts]
    RUNTIME.run(tasks, _fp._forward_task, setup.threads)
    dt = query.dtype
    return (out.astype(dt, copy=False), None if weights is None else weights.astype(dt, copy=False), lse)


def checks_plans() -> bool:
    """Whether every plan is proven before it runs (``QKV_CHECK_PLANS=1``; :mod:`qkv.backends.tiled.proof`)."""
    return os.environ.get("QKV_CHECK_PLANS", "") not in ("", "0")


class TiledBackend(Backend):
    """The tiled engine as a backend (forward, backward, the size rule of ``backend="auto"``)."""

    name = "tiled"
    features = frozenset({"mask", "causal", "dropout", "weights", "lse", "score_mod", "block_mask", "sinks",
                          "backward", "threads"})

    def prefers(self, query, key, value, *, enable_gqa=False) -> bool:
        return self.preference(query, key, value, enable_gqa=enable_gqa)[0]

    def prefers_backward(self, query, key, value, *, enable_gqa=False) -> bool:
        return self.preference(query, key, value, enable_gqa=enable_gqa, backward=True)[0]

    def preference(self, query, key, value, *, enable_gqa=False, backward=False) -> tuple:
        """The size rule of ``backend="auto"``, from the limits in force (:class:`Limits`): forward, at least
        ``auto_tiled_min_scores`` scores, ``auto_tiled_min_head_scores`` a head and ``auto_min_keys`` keys;
        backward, more than ``backward_whole_scores`` scores. ``(prefers, the rule as a sentence)``."""
        lim = current_limits()
        n = shapes.n_scores(query.shape, key.shape, enable_gqa)
        L, S = query.shape[-2], key.shape[-2]
        if backward:
            yes = n > lim.backward_whole_scores
            rule = f"{n:,} scores (tiled above {lim.backward_whole_scores:,}: backward_whole_scores)"
        else:
            yes = (n >= lim.auto_tiled_min_scores and L * S >= lim.auto_tiled_min_head_scores
                   and S >= lim.auto_min_keys)
            rule = (f"{n:,} scores (tiled from {lim.auto_tiled_min_scores:,}), {L * S:,} a head (from "
                    f"{lim.auto_tiled_min_head_scores:,}), {S:,} keys (from {lim.auto_min_keys:,})")
        if yes:
            return True, f"large enough for the tiled engine — {rule}"
        return False, f"below the tiled engine's size rule — {rule}"

    def forward(self, query, key, value, **kw):
        return forward(query, key, value, **kw)

    def backward(self, grad_out, query, key, value, **kw):
        return backward(grad_out, query, key, value, **kw)


TILED = TiledBackend()


def tiled_attention(query, key, value, **kw):
    """The older function form of the tiled backend: ``(output, weights)`` or ``(…, lse)``."""
    return TILED(query, key, value, **kw)


def backward(grad_out, query, key, value, *, attn_mask=None, is_causal=False, scale, enable_gqa=False,
             threads=None, block_q=None, block_k=None, out=None, lse=None, score_mod=None, block_mask=None,
             sink_logits=None):
    """Gradients ``(dQ, dK, dV)`` of ``sum(grad_out ∘ attention(query, key, value))``, tiled; with
    ``sink_logits`` also ``d sink_logits`` (Hq,) last.

    ``out``/``lse`` from a previous :func:`forward` (with ``return_lse=True``) skip its recomputation.
    """
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod, block_mask, sink_logits,
                 backward=True)
    setup = backward_setup(P, block_q, block_k, threads)
    P = setup.problem
    if checks_plans():                                        # QKV_CHECK_PLANS=1: the plan proven first
        from qkv.engine.backends.tiled import proof, schedule
        proof.check(schedule.backward_plan_of(setup))
    bq, bk = setup.bq, setup.bk
    if out is None or lse is None:
        # the output in the compute dtype: D = rowsum(dO ∘ O) from a float16-rounded O cost float16 gradients up
        # to 13× the reference's error (float16 → float32 is exact, the forward computes in float32 anyway)
        q32, k32, v32 = (a.astype(P.cdt, copy=False) for a in (query, key, value))
        out, _, lse = forward(q32, k32, v32, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa, return_lse=True, threads=threads, score_mod=score_mod,
                              block_mask=block_mask, sink_logits=sink_logits)
    prep, d_sink = _bp._prepare(P, grad_out, out, lse)
    kv_lead = shapes.kv_lead(P.lead, P.n_rep)
    dk = np.empty(kv_lead + (P.S, P.E), P.cdt)
    dv = np.empty(kv_lead + (P.S, P.Ev), P.cdt)
    key_starts = list(range(0, P.S, bk))
    tasks, partials = [], []
    for kv_idx in np.ndindex(*kv_lead):
        heads = shapes.query_heads(kv_idx, P.n_rep)
        for c in range(setup.chunks):
            part = np.zeros((len(heads), P.L, P.E), P.cdt)
            partials.append((heads, part))
            tasks.append((P, kv_idx, heads, key_starts[c::setup.chunks], bq, bk, part, dk, dv, prep))
    RUNTIME.run(tasks, _bp._backward_task, setup.threads)
    dq = np.zeros(P.lead + (P.L, P.E), P.cdt)
    for heads, part in partials:
        for r, idx in enumerate(heads):
            dq[idx] += part[r]
    dq *= P.cdt.type(P.scale)                                 # dQ = dS·K·scale
    if P.mod.qdiv != 1.0:
        dk *= P.cdt.type(P.mod.qdiv)                          # qs held Q·scale/cap: dK = dSᵀ·Q·scale
    dt = query.dtype
    dq = _sum_to_shape(dq, query.shape).astype(dt, copy=False)
    dk = _sum_to_shape(dk, key.shape).astype(dt, copy=False)
    dv = _sum_to_shape(dv, value.shape).astype(dt, copy=False)
    if d_sink is None:
        return dq, dk, dv
    return dq, dk, dv, d_sink.astype(np.asarray(sink_logits).dtype, copy=False)
