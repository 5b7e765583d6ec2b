"""How a call is cut, decided before anything runs, for the run and for :func:`qkv.plan` alike.

The forward's tasks — query blocks of ``block_q`` rows per head (``block_q_tiles`` for a block mask in the tile
loop), grouped-query heads a group per task (:data:`qkv.backends.tiled.thresholds.GROUP_GQA`), BLOCK_Q_PLAIN rows
where the compiled loops run, halved while there are fewer than two tasks a worker — or, for so few heads
without a block mask, the heads' rows cut into one share of equal work per worker (:func:`_row_shares`); split-K's
key ranges (:mod:`qkv.backends.tiled.split`); the backward's key blocks per key/value head, dealt among the
workers; whether the call runs on the calling thread alone (``serial_below_flops``). The GEMM provider and the
fused kernels are resolved here, before the tasks, not in a worker.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from qkv import _checks
from qkv.compute import kernels as _kernels, paths as _paths
from qkv.core import shapes
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled import split as _split
from qkv.engine.backends.tiled.plan import Cut, _aligned, _plain_loops, _rows_per_task

F_SHARES = _paths.register("forward.row_shares", "few heads on several workers: their rows cut into one share "
                                                  "of equal work per worker")


class Setup(NamedTuple):
    """How a call is cut, decided before anything runs: the block sizes, split-K's ``splits``, the ``parts`` that
    run in the order they are queued — ``(idx, i0, i1, keys)``, ``keys`` None or, when split, the part's key range
    ``(k0, k1)`` —, the workers, and the ``problem`` as cut (its :class:`~qkv.backends.tiled.plan.Cut`: the one the
    tasks read; the problem given is left as it was)."""
    bq: int
    bk: int
    splits: int
    parts: list
    threads: int
    problem: object


def forward_setup(P, block_q, block_k, threads: int, dropout_p: float, return_weights: bool) -> Setup:
    """The forward's :class:`Setup` for problem ``P`` (the run's and :func:`qkv.plan`'s, one function)."""
    reads_scores = dropout_p > 0 or return_weights
    bq, bk, few, P = _forward_blocks(P, block_q, block_k, threads, reads_scores)
    heads = [idx for idx in np.ndindex(*P.lead) if not idx or idx[-1] % P.group == 0]
    if few and threads > 1 and P.bm is None:
        _paths.hit(F_SHARES)
        rows = [(heads[h], i0, i1, None) for h, i0, i1 in _row_shares(P, len(heads), threads)]
    else:
        starts = list(range(0, P.L, bq))
        if P.is_causal:
            starts.reverse()                                 # the longest rows first: better balance
        rows = [(idx, i0, min(i0 + bq, P.L), None) for i0 in starts for idx in heads]
    if P.bm is not None:                                     # the most cells first: better balance
        work = {}
        for idx in np.ndindex(*P.lead):
            g = P.grid(idx)[0] >= 0
            work[idx] = [int(g[i0 // P.cell:-(-min(i0 + bq, P.L) // P.cell)].sum()) for i0 in range(0, P.L, bq)]
        rows.sort(key=lambda t: -work[t[0]][t[1] // bq])
    splits = _split._key_splits(P, len(rows), threads, bq, bk, dropout_p, return_weights)
    if splits > 1:
        bounds = _split.key_bounds(P, splits, bk)
        parts = [(idx, i0, i1, (bounds[c], bounds[c + 1])) for c in range(splits) for idx, i0, i1, _ in rows]
        return Setup(bq, bk, splits, parts, threads, P)
    if 2 * bq * P.group * P.S * (P.E + P.Ev) < P.limits.serial_below_flops:
        threads = 1
    return Setup(bq, bk, 1, rows, threads, P)


def _forward_blocks(P, block_q, block_k, threads: int, reads_scores: bool) -> tuple:
    """The forward's ``(block_q, block_k, few, problem)``: the given sizes or the limits', aligned to a block mask's
    cells; ``few``: the default block_q was halved for want of tasks (few heads: :func:`_row_shares` then, without
    a block mask); the problem as cut (:class:`~qkv.backends.tiled.plan.Cut`): the heads grouped where they may be,
    a block's budget of scores, the compiled loops' provider and key block where they run (``reads_scores``:
    dropout or weights, which the compiled loops do not do)."""
    lim = P.limits                                           # this call's limits, read once
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else lim.block_q
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else lim.block_k
    n_heads = math.prod(P.lead)
    gemm = RUNTIME.gemm.active()                             # resolve the GEMM provider here, not in a worker
    few, group, budget, plain_block_k = False, 1, None, None
    if P.bm is not None:
        bs = P.bs
        if block_q is None and _tiles_likely(P, reads_scores, gemm):
            bq = lim.block_q_tiles                           # one compiled call a task: taller tasks
        bq = min(_aligned(bq, bs), -(-P.L // bs) * bs)
        # the widest run of keys one matmul takes: block_k when given, else as many as keep a block of
        # scores within block_q × block_k numbers (a cell row of 128 queries takes up to 4096 keys at once)
        bk = _aligned(bk, bs) if block_k is not None else _aligned(P.L + P.S, bs)
        budget = None if block_k is not None else lim.block_q * lim.block_k
        while block_q is None and bq > bs and n_heads * math.ceil(P.L / bq) < 2 * threads:
            bq = _aligned(bq // 2, bs)
    else:
        # Grouped-query heads without masks, mods or sinks: one task takes the query heads that share a
        # key/value head together, their rows interleaved (P.q_rows_group) — one matmul, exp and row pass per
        # block for all of them, where each head took its own (a third of the Python steps for 9 query heads
        # on 3, SmolLM2's prefill); the block keeps about as many rows (block_q positions ÷ group).
        if (lim.group_gqa and P.n_rep > 1 and P.lead and P.mod.kind == "none" and P.mask is None
                and P.sinks is None and not reads_scores):
            group = P.n_rep
            n_heads //= group
            bq = max(1, bq // group) if block_q is None else bq
        if block_q is None:
            bq, few = _halved(P, bq, n_heads, threads)
        else:
            bq = min(bq, P.L)
    # …and load the fused kernels, if blocks use them
    jit = RUNTIME.kernels.for_call(P.cdt, bq * group * min(bk, P.S), lim.kernel_min)
    plain_gemm = _plain_loops(P, jit, gemm)
    if plain_gemm is not None and (P.plain_scores or P.mod_loop) and not reads_scores:   # the compiled loops
        if block_k is None and P.S > bk:                     # (keys of one block_k block stay one block)
            plain_block_k = lim.block_k_plain
        if block_q is None:
            bq, few = _halved(P, max(1, lim.block_q_plain // group), n_heads, threads)
    return bq, bk, few, P.with_cut(Cut(group, budget, plain_gemm, plain_block_k))


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
    Kept per shape in the runtime's memo (:func:`_shares`): a decoder's layers ask the same, and it took 0.12 ms of each of SmolLM2's
    attention calls before their tasks started."""
    key = ("shares", P.L, P.S, bool(P.is_causal), n_heads, threads, align)
    return list(RUNTIME.memo.get(key, lambda: _shares(*key[1:])))


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


class BackwardSetup(NamedTuple):
    """How a backward is cut: its block sizes, each key/value head's key blocks dealt into ``chunks`` tasks, the
    workers, and the problem as cut (the compiled loop's provider)."""
    bq: int
    bk: int
    chunks: int
    threads: int
    problem: object


def backward_setup(P, block_q, block_k, threads: int) -> BackwardSetup:
    """The backward's :class:`BackwardSetup` for problem ``P``, the GEMM provider and fused kernels resolved (not in
    a worker), the compiled loop's provider in its cut where it runs (the run's and :func:`qkv.plan`'s)."""
    lim = P.limits                                           # this call's limits, read once
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else lim.block_q_backward
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else lim.block_k_backward
    if P.bm is not None:
        bq, bk = _aligned(bq, P.bs), _aligned(bk, P.bs)
    n_kv = math.prod(shapes.kv_lead(P.lead, P.n_rep))
    chunks = max(1, min(-(-P.S // bk), math.ceil(threads / n_kv))) if threads > 1 else 1
    if 2 * min(bk, P.S) * P.L * (2 * P.E + 3 * P.Ev) * P.n_rep < lim.serial_below_flops:
        threads = 1
    gemm = RUNTIME.gemm.active()
    jit = RUNTIME.kernels.for_call(P.cdt, min(bq, P.L) * min(bk, P.S), lim.kernel_min)
    return BackwardSetup(bq, bk, chunks, threads, P.with_cut(Cut(plain_gemm=_plain_loops(P, jit, gemm))))
