"""The tiled backend's entry points: :func:`forward`, :func:`backward` and :class:`TiledBackend`.

A call builds the problem (:class:`qkv.backends.tiled.plan._Problem`, which reads the limits in force once),
sizes its tasks — the forward's: query blocks of ``block_q`` rows per head (``block_q_tiles`` for a block mask
in the tile loop), grouped-query heads a group per task (:data:`qkv.backends.tiled.thresholds.GROUP_GQA`),
BLOCK_Q_PLAIN rows where the compiled loops run, halved while
there are fewer than two tasks a worker — or, for so few heads without a block mask, the heads' rows cut into
one share of equal work per worker (:func:`_row_shares`); the backward's: key blocks per key/value head, chunked among the
workers — and runs them on the runtime's pool (:mod:`qkv.backends.runtime`: :func:`get_num_threads` workers,
each pinned to its own CPU, BLAS limited to one thread each while they run; NumPy releases the GIL inside its
matmuls and ufunc loops). Tasks too small to pay for the GIL hand-offs (``serial_below_flops``) run on the
calling thread; a decode-like problem with fewer tasks than workers has its key range split among them
(:mod:`qkv.backends.tiled.split`). The GEMM provider and the fused kernels are resolved here, before the tasks,
not in a worker.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ... import _checks, kernels as _kernels, paths as _paths, shapes
from ..base import Backend
from ..runtime import RUNTIME
from . import backward_pass as _bp, forward_pass as _fp, split as _split
from .plan import _Problem, _aligned, _plain_loops, _rows_per_task
from .thresholds import current_limits

_sum_to_shape = shapes.sum_to_shape
F_SHARES = _paths.register("forward.row_shares", "few heads on several workers: their rows cut into one share "
                                                  "of equal work per worker")


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
    bq, bk, few = _forward_blocks(P, block_q, block_k, threads, dropout_p > 0 or return_weights)
    out = np.empty(P.lead + (P.L, P.Ev), P.cdt)
    lse = np.empty(P.lead + (P.L,), P.cdt) if return_lse else None
    weights = np.zeros(P.lead + (P.L, P.S), P.cdt) if return_weights else None
    if dropout_p > 0 and rng is None:
        rng = np.random.default_rng()
    seed = int(rng.integers(2**63)) if dropout_p > 0 else 0
    heads = [idx for idx in np.ndindex(*P.lead) if not idx or idx[-1] % P.group == 0]
    if few and threads > 1 and P.bm is None:
        _paths.hit(F_SHARES)
        rows = [(heads[h], i0, i1) for h, i0, i1 in _row_shares(P, len(heads), threads)]
    else:
        starts = list(range(0, P.L, bq))
        if is_causal:
            starts.reverse()                                 # the longest rows first: better balance
        rows = [(idx, i0, min(i0 + bq, P.L)) for i0 in starts for idx in heads]
    tasks = [(P, idx, i0, i1, bk, out, lse, weights, dropout_p, seed) for idx, i0, i1 in rows]
    if block_mask is not None:                               # the most cells first: better balance
        work = {}
        for idx in np.ndindex(*P.lead):
            g = P.grid(idx)[0] >= 0
            work[idx] = [int(g[i0 // P.cell:-(-min(i0 + bq, P.L) // P.cell)].sum()) for i0 in range(0, P.L, bq)]
        tasks.sort(key=lambda t: -work[t[1]][t[2] // bq])
    splits = _split._key_splits(P, len(tasks), threads, bq, bk, dropout_p, weights is not None)
    if splits > 1:
        return _split._forward_split(P, tasks, splits, bk, threads, query.dtype, return_lse)
    if 2 * bq * P.group * P.S * (P.E + P.Ev) < P.limits.serial_below_flops:
        threads = 1
    RUNTIME.run(tasks, _fp._forward_task, threads)
    dt = query.dtype
    return (out.astype(dt, copy=False), None if weights is None else weights.astype(dt, copy=False), lse)


def _forward_blocks(P, block_q, block_k, threads: int, reads_scores: bool) -> tuple:
    """The forward's ``(block_q, block_k, few)``: the given sizes or the limits', aligned to a block mask's
    cells; the heads grouped where they may be (``P.group``), the compiled loops' provider and key block set
    where they run (``reads_scores``: dropout or weights, which the compiled loops do not do); ``few``: the
    default block_q was halved for want of tasks (few heads: :func:`_row_shares` then, without a block mask)."""
    lim = P.limits                                           # this call's limits, read once
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else lim.block_q
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else lim.block_k
    n_heads = math.prod(P.lead)
    gemm = RUNTIME.gemm.active()                             # resolve the GEMM provider here, not in a worker
    few = False
    if P.bm is not None:
        bs = P.bs
        if block_q is None and _tiles_likely(P, reads_scores, gemm):
            bq = lim.block_q_tiles                           # one compiled call a task: taller tasks
        bq = min(_aligned(bq, bs), -(-P.L // bs) * bs)
        # the widest run of keys one matmul takes: block_k when given, else as many as keep a block of
        # scores within block_q × block_k numbers (a cell row of 128 queries takes up to 4096 keys at once)
        bk = _aligned(bk, bs) if block_k is not None else _aligned(P.L + P.S, bs)
        P.fwd_budget = None if block_k is not None else lim.block_q * lim.block_k
        while block_q is None and bq > bs and n_heads * math.ceil(P.L / bq) < 2 * threads:
            bq = _aligned(bq // 2, bs)
    else:
        # Grouped-query heads without masks, mods or sinks: one task takes the query heads that share a
        # key/value head together, their rows interleaved (P.q_rows_group) — one matmul, exp and row pass per
        # block for all of them, where each head took its own (a third of the Python steps for 9 query heads
        # on 3, SmolLM2's prefill); the block keeps about as many rows (block_q positions ÷ group).
        if (lim.group_gqa and P.n_rep > 1 and P.lead and P.mod.kind == "none" and P.mask is None
                and P.sinks is None and not reads_scores):
            P.group = P.n_rep
            n_heads //= P.group
            bq = max(1, bq // P.group) if block_q is None else bq
        if block_q is None:
            bq, few = _halved(P, bq, n_heads, threads)
        else:
            bq = min(bq, P.L)
    # …and load the fused kernels, if blocks use them
    jit = RUNTIME.kernels.for_call(P.cdt, bq * P.group * min(bk, P.S), lim.kernel_min)
    _plain_loops(P, jit, gemm)
    if P.plain_gemm is not None and (P.plain_scores or P.mod_loop) and not reads_scores:   # the compiled loops
        if block_k is None and P.S > bk:                     # (keys of one block_k block stay one block)
            P.plain_block_k = lim.block_k_plain
        if block_q is None:
            bq, few = _halved(P, max(1, lim.block_q_plain // P.group), n_heads, threads)
    return bq, bk, few


def _halved(P, bq: int, n_heads: int, threads: int) -> tuple:
    """:func:`~qkv.backends.tiled.plan._rows_per_task`'s query block from ``bq``, and whether it is smaller
    than ``bq`` (or L) — halved for want of tasks."""
    got = _rows_per_task(P, bq, n_heads, threads)
    return got, got < min(bq, P.L)


def _row_shares(P, n_heads: int, threads: int, align: int = 16) -> list:
    """``(head, i0, i1)`` pieces for few heads on several workers: the heads' rows laid end to end and cut into
    ``threads`` shares of equal work — a row's work the keys it may see, ``min(i + 1, S)`` under the causal
    mask, S otherwise — at multiples of ``align`` rows; the pieces largest first, so that the runtime's queue
    hands each worker about one share. SmolLM2's prefill (3 key/value heads of 512 rows, causal, 2 workers):
    4 tasks, two heads whole and one cut at row 368, where blocks halved until each worker had two tasks made
    6 of work 3:1 (each task's setup, 0.15–0.3 ms, paid 6 times, and more of them on both workers at once).
    Kept per shape (:func:`_shares`): a decoder's layers ask the same, and it took 0.12 ms of each of SmolLM2's
    attention calls before their tasks started."""
    return list(_shares(P.L, P.S, bool(P.is_causal), n_heads, threads, align))


@functools.lru_cache(maxsize=256)
def _shares(L: int, S: int, causal: bool, n_heads: int, threads: int, align: int) -> tuple:
    """:func:`_row_shares`' pieces for these shapes, as a tuple."""
    seen = np.minimum(np.arange(1, L + 1), S) if causal else np.full(L, S)
    cum = np.concatenate(([0], np.cumsum(seen, dtype=np.int64)))    # cum[i]: the work of rows 0 … i − 1
    per = int(cum[-1])
    cuts: list = [set() for _ in range(n_heads)]
    for t in range(1, threads):
        h, rest = divmod(t * n_heads * per // threads, per)
        i = min(L, int(round(int(np.searchsorted(cum, rest)) / align)) * align)
        if h < n_heads and 0 < i < L:
            cuts[h].add(i)
    pieces = []
    for h in range(n_heads):
        edges = [0, *sorted(cuts[h]), L]
        pieces += [(h, a, b) for a, b in zip(edges[:-1], edges[1:])]
    return tuple(sorted(pieces, key=lambda p: -int(cum[p[2]] - cum[p[1]])))


def _tiles_likely(P, reads_scores: bool, gemm) -> bool:
    """Whether a block-mask problem's tasks will run in the compiled loop with tiles: allowed
    (:meth:`~qkv.backends.tiled.plan._Problem.tile_loop_allowed`), float32 with numba's kernels and a C sgemm
    — all but each task's scores' bound, which :meth:`~qkv.backends.tiled.forward_pass._Task._bounds` checks."""
    return (P.tile_loop_allowed(not reads_scores) and P.cdt == np.float32 and RUNTIME.kernels.get() == "numba"
            and _kernels.plain_available(gemm))


class TiledBackend(Backend):
    """The tiled engine as a backend (forward, backward, the size rule of ``backend="auto"``)."""

    name = "tiled"
    features = frozenset({"mask", "causal", "dropout", "weights", "lse", "score_mod", "block_mask", "sinks",
                          "backward", "threads"})

    def prefers(self, query, key, value, *, enable_gqa=False) -> bool:
        per_head = query.shape[-2] * key.shape[-2]
        lim = current_limits()
        return (shapes.n_scores(query.shape, key.shape, enable_gqa) >= lim.auto_tiled_min_scores
                and per_head >= lim.auto_tiled_min_head_scores and key.shape[-2] >= lim.auto_min_keys)

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
    lim = P.limits                                           # this call's limits, read once
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else lim.block_q_backward
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else lim.block_k_backward
    if block_mask is not None:
        bq, bk = _aligned(bq, P.bs), _aligned(bk, P.bs)
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
    n_chunks = max(1, min(len(key_starts), math.ceil(threads / math.prod(kv_lead)))) if threads > 1 else 1
    tasks, partials = [], []
    for kv_idx in np.ndindex(*kv_lead):
        heads = shapes.query_heads(kv_idx, P.n_rep)
        for c in range(n_chunks):
            part = np.zeros((len(heads), P.L, P.E), P.cdt)
            partials.append((heads, part))
            tasks.append((P, kv_idx, heads, key_starts[c::n_chunks], bq, bk, part, dk, dv, prep))
    if 2 * min(bk, P.S) * P.L * (2 * P.E + 3 * P.Ev) * P.n_rep < lim.serial_below_flops:
        threads = 1
    gemm = RUNTIME.gemm.active()                             # resolve the GEMM provider here, not in a worker
    jit = RUNTIME.kernels.for_call(P.cdt, min(bq, P.L) * min(bk, P.S), lim.kernel_min)   # …and the fused kernels
    _plain_loops(P, jit, gemm)
    RUNTIME.run(tasks, _bp._backward_task, threads)
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
