"""The forward pass: the online softmax of one task, by the first strategy that supports it.

A task is a block of query rows of one head — or of the query heads that share a key/value head, their rows
interleaved (row ``r·g + h`` is position ``r`` of head ``h``) — walking the key blocks of its plan
(:mod:`qkv.backends.tiled.plan`). FlashAttention's online softmax (Rabe & Staats; Dao et al.) keeps, per
query row, the running max ``m_i``, the running sum ``l_i`` of ``exp(s − m_i)`` and the running weighted sum
``acc`` of the value rows; when a block raises the max, ``l_i`` and ``acc`` are rescaled by
``alpha = exp(m_old − m_new)``. At the end ``output = acc / l_i`` and ``lse = m_i + log l_i``. Memory is
O(block_q · block_k) per worker. In NumPy every elementwise pass over a block costs about a sixth of its
product, so the strategies below make a block, as often as they can, just matmul → exp → matmul (``l_i``
accumulates ``P·1``, a matrix-vector product, a fifth of NumPy's row sum).

**The strategies.** A task runs the first of :data:`STRATEGIES` whose ``supports(P, task)`` holds. *The
compiled loop, base 2* (``forward.plain_loop``) takes plain blocks — no mod, no mask but the causal one, no
weights or dropout — whose scores are provably small: the whole task runs in numba, its products by the GEMM
provider's C sgemm, P·V accumulated by the GEMM's beta, ``m_i = 0`` and log₂ e folded into the query rows so
that the exponential is 2^s. *The compiled loop, lazy* (``forward.plain_loop_lazy``) takes the same blocks with
larger scores, the lazy rescaling compiled in. *The compiled loop, mods* (``forward.mod_loop``) takes the
shift-free tasks under ALiBi (causal), a softcap or both, no mask: the plain loop with the mod in its row pass
(:mod:`qkv.compute._jit_mods`), in base 2 as well. *Batched bands* (``forward.bands``) take a block mask's runs of
bands (a sliding window's cell rows) when the scores are small: each run is one batched product, pattern, exp
and P·V over strided views. *Shift-free blocks* (``forward.shift_free``) take any other task whose scores are
provably within ``±shift_free_bound`` (Cauchy–Schwarz on the rows' norms; softcap by its cap; ALiBi under a
causal mask that allows the diagonal): softmax is shift invariant and the max is subtracted only so that
``exp`` cannot overflow, so ``m_i = 0`` for good — no max pass, no rescaling — and ALiBi's column term folds
into V and the row sums (``forward.alibi_fold``). *Rescaled blocks* take the rest (large scores, float masks,
custom mods): ``−m_i`` is a column of the query block and the keys a row of ones, so the product itself yields
``s − m_i``; a block is exponentiated against the ``m_i`` it finds and kept while its row sums stay below
``exp(lazy_bound)`` (``forward.lazy``), else — or while a row has seen no key — redone with the max pass
(``forward.max_pass``), which raises ``m_i`` and rescales ``l_i`` and ``acc``; ALiBi's blocks go largest bias
first, so the max is rarely raised. After the blocks, the *sinks merge* (``forward.sinks``: a sink is one more
key with no value, a partial result ``out = 0``, ``lse = sink_h``, merged by :func:`qkv.merge.merge_partials`)
and the *weights pass* (``forward.weights``: ``exp(s − lse)`` stored, block by block). All strategies give the
same numbers up to rounding; the tests drive each.

In the compiled loops a block costs no Python of its own, so a causal diagonal is split down to squares of
``diagonal_min_plain`` (32) rows — 0.75 % of the computed scores thrown away at N = 4096, where 256-row squares
threw 5.9 % — and a task is ``block_q_plain`` rows against key blocks of ``block_k_plain``, which the plan cuts
into pieces of ``band_rows_plain`` × ``band_keys_plain`` taken band by band (small products OpenBLAS multiplies
without packing, a band's rows kept in cache: :func:`qkv.backends.tiled.plan._banded`); where the provider
has no C sgemm qkv can find, the Python loop runs. With the fused kernels (:mod:`qkv.kernels`, numba) a
Python-loop block's elementwise steps after ``Q·Kᵀ`` — softcap, the causal diagonal's mask, the shift, ``exp``
and the row sums — are one compiled pass; without them, NumPy's passes (``forward.numpy_block``). Dropout
draws its keep-mask per task from ``SeedSequence([seed, head, block start])``: reproducible for a given ``rng``,
shapes and block sizes, whatever the thread count.

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width;
Bq a task's rows (positions × grouped heads), bk a block's keys.
"""
from __future__ import annotations

import math
import threading
import types
from typing import Callable, NamedTuple

import numpy as np

from qkv.compute import kernels as _kernels
from qkv.compute import paths as _paths
from qkv.compute.gemm import exp as _exp, matmul as _mm  # matmuls and block exps by the runtime's provider (qkv.gemm)
from qkv.compute.kernels import NO_MASK as _NO_MASK
from qkv.engine.backends.runtime import RUNTIME
from qkv.core.merge import merge_partials
from qkv.engine.backends.tiled.bands import _band_groups
from qkv.engine.backends.tiled.plan import _LOG_HEADROOM, _first_rows, _plain_plan, _task_blocks
from qkv.engine.backends.tiled.scoring import _Scorer, _apply_poly, _cached, _scratch
from qkv.engine.backends.tiled.sparse import masked_plan

_LOG2E = 1.4426950408889634                                 # log₂ e: 2^(s·log₂ e) = e^s
_NO_COEF = np.zeros(7, np.float32)                          # the compiled loop's polynomial where it has none

# Every strategy, counted where it runs (qkv.paths): the differential matrix proves it walks each one.
_R = _paths.register
F_PLAIN = _R("forward.plain_loop", "a task's plain blocks in one compiled loop, shift-free, base 2")
F_TILES = _R("forward.tile_loop", "a block-mask task's cells in the compiled loop: full cells plain, partial "
                                  "cells by their tiles")
F_STRIPS = _R("forward.tile_loop.strips", "a block-mask task's band cells (a window's edges) in strips, both "
                                          "edges masked in the compiled loop")
F_MODS = _R("forward.mod_loop", "a task's blocks under ALiBi, a softcap or both in one compiled loop, shift-free, "
                                "base 2")
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


# ---------------------------------------------------------------------------------------------- the task
class _Task:
    """One forward task — query rows i0 … i1 of head ``idx`` (and of the ``g − 1`` heads after it when grouped) —
    what its strategy needs, and its online-softmax state: ``m_i`` the running max (the shift actually
    subtracted), ``l_i`` the running ``Σ exp(s − m_i)`` (before dropout), ``acc`` the running ``Σ exp(s − m_i)·v``,
    ``seen`` whether ``m_i`` is a max some block attained; all (Bq,) or (Bq, Ev), Bq = (i1 − i0)·g."""

    __slots__ = ("idx", "i0", "i1", "g", "keys", "K", "V", "K_T", "qs", "sc", "jit", "blocks", "widest", "tallest",
                 "shift_free", "bounded", "base2", "mod_loop", "lazy", "row_limit", "fold_col", "loop_plan", "s_flat",
                 "ones", "tmp", "v_buf", "l_blk", "m_i", "l_i", "acc", "seen", "added", "gen", "dropout_p", "keep_scale",
                 "tiles")

    def __init__(self, P, idx, i0, i1, block_k, weights, dropout_p, seed, keys):
        self.idx, self.i0, self.i1, self.keys, self.dropout_p = idx, i0, i1, keys, dropout_p
        K, self.V, k_norm, v_max, self.K_T = P.kv(idx)          # (S, E), (S, Ev), (E+1, S)
        mask2d = P.mask2d(idx)
        self.g = g = P.group                                     # rows per position: g interleaved query heads
        Bq, E = (i1 - i0) * g, P.E
        self.qs = qs = np.empty((Bq, E + 1), P.cdt)              # [Q·scale, row term]: scale folded in once
        qs[:, E] = 0.0
        self.blocks, self.widest, self.tallest, self.jit = None, 1, 1, None
        if mask2d is None and P.bm is None:                      # the blocks depend on the shapes alone: made once
            self._blocks(P, _cached(("blocks", P.is_causal, i0, i1, P.S, block_k, g, keys, P.limits.diagonal_min),
                                    lambda: _task_blocks(P, idx, i0, i1, None, block_k, g, keys)))
        self.sc = _Scorer(P, idx, qs, i0, self.K_T, mask2d, row_col=True)
        self._bounds(P, k_norm, v_max, weights is None and dropout_p == 0)
        if self.blocks is None and self.tiles is None:           # (a block mask's task in tiles needs none)
            self._blocks(P, _task_blocks(P, idx, i0, i1, mask2d, block_k, g, keys))
        self._alibi_order()
        self.gen = _dropout_rng(seed, P.lead, idx, i0) if dropout_p > 0 else None
        self.keep_scale = 0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)
        self._buffers(P, block_k)
        if g > 1:
            _paths.hit(F_GROUP)

    def _bounds(self, P, k_norm: float, v_max: float, alone: bool) -> None:
        """What the scores' bound allows: shift-free, base 2, a softcap polynomial, lazy rescaling; the query
        rows scaled accordingly (``alone``: nothing but the output reads the scores — no weights, no dropout)."""
        idx, i0, i1, sc, E = self.idx, self.i0, self.i1, self.sc, P.E
        # max |Q·scale| of the rows, before they are scaled: with the kernels, in the pass that scales them,
        # by the factor the task most likely takes (log₂ e where its scores may be plain — unless the last task
        # planned, in this call or an earlier one, took e: a model's scores are rarely shift-free, and each of
        # its layers is a call; redone if wrong)
        may = alone and (sc.kind == "none" and (P.plain_scores or P.bm is not None)
                         or sc.kind == "alibi" and P.mod_loop and P.plain_gemm is not None)
        guess = _LOG2E if may and RUNTIME.base2_guess.get() is not False else 1.0
        q_norm = P.q_prep(idx, i0, i1, self.qs, guess)
        scaled = q_norm is not None
        if not scaled:
            q_norm = P.q_norm_group(idx, i0, i1)
        # How large a block's Σ exp(s − m_i) may grow before acc could overflow (float32 and float64 alike).
        log_room = _LOG_HEADROOM - math.log(P.S) - math.log1p(v_max)
        # Shift-free: no (modified) score can leave the bounds of P.shift_free, so m_i = 0 for good.
        self.shift_free = shift_free = P.shift_free(q_norm * k_norm * P.mod.qdiv, log_room, sc.slope)
        plain = shift_free and sc.kind == "none"            # scores within ±shift_free_bound, unmodified
        # Base 2: log₂ e folded into the query rows' scale (one rounding), so that a plain block's exponential is
        # 2^s — e^score with a third less work in the kernel (qkv.kernels.run, base2). Where every block is
        # "full" or "causal" and nothing else reads the scores (no weights' second pass, no dropout, no mask or
        # bands), and shift-free: the lazy blocks' larger scores (up to ~100 on the tests' inputs) made the
        # backward's P, recomputed from e^s and this lse, off from the forward's by the two matmuls' rounding
        # (1.7–4× the gradients' error against float64); within ±30 the error is as before.
        bare = self.jit is not None and P.plain_scores and alone   # products, exponentials and row sums alone
        # a block mask's cells in the compiled loop (sparse.masked_plan): full cells plain, partial ones tiled
        self.tiles = None
        # (not a split-K part: the tile plan covers all of a row's keys — each part took them all, found by the plan
        # checker with block_k given)
        if shift_free and P.plain_gemm is not None and P.tile_loop_allowed(alone) and self.keys is None:
            # one compiled call for the whole task: the kernels by the task's size, not its largest block's
            jit = RUNTIME.kernels.for_block(P.cdt, (i1 - i0) * self.g * P.S, P.limits.kernel_min)
            self.tiles = None if jit is None else masked_plan(P, idx, i0, i1, self.g, P.limits.block_k)
            if self.tiles is not None:
                self.jit = jit
        # ALiBi, a softcap or both in the compiled loop (qkv.kernels.run_mods), in base 2: log₂ e in the rows
        # for ALiBi alone, in the softcap's coefficients otherwise
        self.mod_loop = (shift_free and sc.kind != "none" and alone and self.jit is not None
                         and P.plain_gemm is not None and P.mod_loop)
        self.base2 = (bare or self.tiles is not None or self.mod_loop and sc.cap is None) and shift_free
        RUNTIME.base2_guess.set(self.base2)                 # (tasks on other workers may read either: a guess)
        factor = _LOG2E if self.base2 else 1.0
        if not scaled:
            P.q_rows_group(idx, i0, i1, self.qs[:, :E], factor)
        elif factor != guess:                               # the guess was wrong: the compiled pass again
            P.q_prep(idx, i0, i1, self.qs, factor)
        k_poly = sc.use_poly(q_norm * k_norm)               # softcap: |s/cap| ≤ q_norm·k_norm (qs holds 1/cap)
        if k_poly != 1.0:
            self.qs[:, :E] *= P.cdt.type(k_poly)
        # no mod and nothing masked but the causal diagonal (the kernel's limit): every score within the
        # bound, so the exponential needs no clamps
        self.bounded = plain
        # Otherwise lazy rescaling: m_i (folded into the matmul as qs[:, E] = −m_i) is a max some block attained;
        # a block is exponentiated against it as is, and only when its row sums grow past exp(lazy_bound) (or a
        # row has seen nothing yet) is it redone with a max pass and a rescale.
        self.lazy = not shift_free and self.dropout_p == 0 and log_room > P.limits.lazy_bound + 1
        self.row_limit = math.exp(P.limits.lazy_bound)
        # ALiBi's column term folded into V: only shift-free (m_i = 0 for good), where a factor e^{c_j} ≤ 1
        # cannot hide a row's max from a running-max update
        self.fold_col = (shift_free and sc.kind == "alibi" and sc.slope is not None and sc.slope >= 0
                         and not self.mod_loop)
        self.loop_plan = bare and P.plain_gemm is not None or self.mod_loop   # the compiled loops' plan: _buffers

    def _blocks(self, P, got) -> None:
        """The task's blocks, the widest's keys and the tallest's rows, and the fused block kernels for them
        (qkv.kernels: mask, softcap, shift, exp and row sums in one pass), where in use."""
        self.blocks, self.widest, self.tallest = got
        self.jit = RUNTIME.kernels.for_block(P.cdt, self.tallest * self.widest, P.limits.kernel_min)

    def _alibi_order(self) -> None:
        """ALiBi's rescaled blocks with the largest bias first (the diagonal, for a causal ALiBi): later ones
        then rarely raise the running max, where in key order every block of a steep head would be redone."""
        sc, i0 = self.sc, self.i0
        if not self.shift_free and sc.kind in ("alibi", "alibi_softcap") and sc.slope is not None:
            sl = sc.slope
            self.blocks = sorted(self.blocks, key=lambda b: -(sl * (b[3] - 1 - (i0 + b[0])) if sl >= 0
                                                              else sl * (b[2] - (i0 + b[1] - 1))))

    def _buffers(self, P, block_k) -> None:
        """The compiled loops' plan (where they run) and the buffers: a block's scores, then probabilities
        (the compiled loop's: as many as its largest block), and the softmax state."""
        i0, i1, g, keys, Bq, Ev = self.i0, self.i1, self.g, self.keys, self.qs.shape[0], P.Ev
        room = self.tallest * self.widest
        if self.tiles is not None:                               # (plan, tiles, room): made once, kept
            self.loop_plan, room = self.tiles[0], max(room, self.tiles[2])
        elif self.loop_plan:
            # the whole loop compiled, the GEMMs by the provider's C function — the same steps as the Python
            # loop's, without the Python between them; with no per-block cost of its own, a causal diagonal in
            # smaller squares (less computed for nothing). The plan depends on the shapes alone: made once, kept.
            pbk = P.plain_block_k or block_k
            lim = P.limits
            self.loop_plan, room = _cached(("plain", P.is_causal, i0, i1, P.S, pbk, g, keys, lim.diagonal_min_plain,
                                            lim.band_rows_plain, lim.band_keys_plain),
                                           lambda: _plain_plan(P, i0, i1, pbk, g, keys))
        else:
            self.loop_plan = None
        self.s_flat = _scratch(1, room, P.cdt).reshape(-1)
        self.ones = np.ones(self.widest, P.cdt)
        self.tmp = np.empty((Bq, Ev), P.cdt) if self.loop_plan is None else None
        self.v_buf = np.empty((self.widest, Ev), P.cdt) if self.fold_col else None
        self.l_blk = np.empty(Bq, P.cdt)                         # a block's row sums
        self.acc = np.zeros((Bq, Ev), P.cdt)                     # Σ p·v per row
        self.l_i = np.zeros(Bq, P.cdt)                           # Σ p per row (before dropout)
        self.m_i = np.zeros(Bq, P.cdt)                           # running max (the shift actually subtracted)
        self.seen = np.full(Bq, self.shift_free)                 # m_i is a max some block attained
        self.added = []                                          # (r0, r1) of the shift-free steps accumulated



def _dropout_rng(seed, lead, idx, i0):
    flat = int(np.ravel_multi_index(idx, lead)) if lead else 0
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, flat, i0])))


def _drop(T, s) -> None:
    """Dropout on a block of probabilities: its keep-mask drawn from the task's generator, the kept scaled."""
    _paths.hit(F_DROPOUT)
    keep = T.gen.random(s.shape, dtype=np.float32) >= T.dropout_p
    np.multiply(s, keep, out=s)
    s *= T.keep_scale


# ---------------------------------------------------------------------------------------------- strategies
class Strategy(NamedTuple):
    """A way of running a forward task: ``supports(P, task)`` says whether it can, ``run(P, task)`` does."""
    name: str
    supports: Callable
    run: Callable


def _compiled_base2(P, T) -> None:
    """The task's plain, bounded blocks in one compiled loop (:func:`qkv.kernels.run_plain`): per block
    ``S = Q·Kᵀ`` (log₂ e in Q), ``P = 2^S``, ``l_i += P·1``, ``acc += P·V_j`` — ``m_i = 0`` for good."""
    _paths.hit(F_PLAIN)
    _kernels.run_plain(T.jit, P.plain_gemm, T.qs, T.K_T, T.V, T.loop_plan, T.s_flat, T.acc, T.l_i, T.l_blk,
                       T.sc.zeros, T.g)


def _compiled_tiles(P, T) -> None:
    """A block-mask task in the compiled loop (:mod:`qkv.backends.tiled.sparse`): its full cells as plain blocks,
    its band cells in strips with their edges, other partial cells with their 0/1 tiles, its empty cells not
    at all — shift-free, base 2."""
    _paths.hit(F_TILES)
    if T.tiles[3]:
        _paths.hit(F_STRIPS)
    _kernels.run_tiles(T.jit, P.plain_gemm, T.qs, T.K_T, T.V, T.loop_plan, T.tiles[1], T.s_flat, T.acc, T.l_i,
                       T.l_blk, T.sc.zeros, T.g)


def _compiled_mods(P, T) -> None:
    """A shift-free task under ALiBi, a softcap or both in one compiled loop (:func:`qkv.kernels.run_mods`), in
    base 2: log₂ e in the query rows and the slope for ALiBi alone, in the softcap's polynomial or cap
    otherwise; the bias as the Python loop rounds it."""
    _paths.hit(F_MODS)
    sc = T.sc
    kind, coef, cap = 0, _NO_COEF, 0.0
    if sc.poly is not None:                                  # the fitted polynomial (its top coefficient ±1)
        kind, coef = 1, (sc.poly_coef.astype(np.float64) * _LOG2E).astype(np.float32)
    elif sc.cap is not None:
        kind, cap = 2, float(sc.cap) * _LOG2E
    slope = math.nan if sc.slope is None else sc.slope * (_LOG2E if T.base2 else 1.0)
    _kernels.run_mods(T.jit, P.plain_gemm, T.qs, T.K_T, T.V, T.loop_plan, T.s_flat, T.acc, T.l_i, T.l_blk, T.g,
                      T.i0, kind, coef, cap, slope)


def _compiled_lazy(P, T) -> None:
    """The task's plain blocks with larger scores in one compiled loop (:func:`qkv.kernels.run_plain_lazy`):
    the lazy rescaling and the max pass of :func:`_lazy_block` / :func:`_max_pass_block`, compiled."""
    _paths.hit(F_PLAIN_LAZY)
    _kernels.run_plain_lazy(T.jit, P.plain_gemm, T.qs, T.K_T, T.V, T.loop_plan, T.s_flat, T.acc, T.l_i, T.m_i,
                            T.seen, T.l_blk, T.sc.zeros, T.g, T.lazy, T.row_limit)


def _bands_supported(P, T) -> bool:
    """Shift-free blocks of a block mask, no dropout, and a mod the band pattern carries (none, ALiBi, softcap)."""
    sc = T.sc
    return (T.shift_free and T.gen is None and P.bm is not None
            and sc.kind in ("none", "alibi", "softcap", "alibi_softcap")
            and (sc.kind == "none" or sc.slope is not None or sc.cap is not None))


def _banded_blocks(P, T) -> None:
    """The plan's runs of bands batched (:func:`_bands`), the other blocks shift-free (:func:`_shift_free_block`)."""
    slope = T.sc.slope if T.sc.kind in ("alibi", "alibi_softcap") else None
    for step in _band_groups(P, T.blocks, T.i0, slope, P.limits.band_group_scores):
        if step[0] == "bands":
            _bands(P, T, step)
        else:
            _shift_free_block(P, T, step)


def _shift_free_blocks(P, T) -> None:
    """Every block shift-free (:func:`_shift_free_block`)."""
    for step in T.blocks:
        _shift_free_block(P, T, step)


def _rescaled_blocks(P, T) -> None:
    """Every block lazily (:func:`_lazy_block`) where each of its rows has a max already and the lazy bound
    allows it — these rows, not the whole task's: a causal diagonal's lower rows first see keys in a later
    block than the upper ones (measured on SmolLM2's prefill, 512 rows, 7 blocks: a task-wide test sent ~90 %
    of the scores to the max pass) — else, or when its row sums grew too much, with the max pass."""
    g, seen, lazy = T.g, T.seen, T.lazy
    for step in T.blocks:
        if not (lazy and seen[step[0] * g:step[1] * g].all() and _lazy_block(P, T, step)):
            _max_pass_block(P, T, step)


#: The forward's strategies, in the order they are tried: a task runs the first that supports it.
STRATEGIES = (
    Strategy("compiled loop, tiles", lambda P, T: T.tiles is not None, _compiled_tiles),
    Strategy("compiled loop, mods", lambda P, T: T.loop_plan is not None and T.mod_loop, _compiled_mods),
    Strategy("compiled loop, base 2", lambda P, T: T.loop_plan is not None and T.shift_free and T.sc.kind == "none",
             _compiled_base2),
    Strategy("compiled loop, lazy", lambda P, T: T.loop_plan is not None and T.sc.kind == "none", _compiled_lazy),
    Strategy("batched bands", _bands_supported, _banded_blocks),
    Strategy("shift-free blocks", lambda P, T: T.shift_free, _shift_free_blocks),
    Strategy("rescaled blocks", lambda P, T: True, _rescaled_blocks),
)


def _strategy(P, T) -> Strategy:
    """The first of :data:`STRATEGIES` that supports the task."""
    for st in STRATEGIES:
        if st.supports(P, T):
            return st
    raise AssertionError("no forward strategy supports the task")       # the last supports every task


#: Why a task takes each strategy: what it has that the strategy needs (never written).
_TAKES = types.MappingProxyType({
    "compiled loop, tiles": "a block mask, no score mod or attn_mask, only the output reads the scores, scores "
                            "shift-free: full cells plain, partial ones by tiles or band edges",
    "compiled loop, mods": "ALiBi and/or a softcap, no mask, only the output reads the scores, scores shift-free",
    "compiled loop, base 2": "plain scores (no mod, no mask but the causal one), only the output reads them, "
                             "shift-free",
    "compiled loop, lazy": "plain scores, only the output reads them, but not provably within the shift-free "
                           "bound: lazy rescaling compiled in",
    "batched bands": "a block mask, shift-free, a mod the band pattern carries",
    "shift-free blocks": "scores provably within the shift-free bound: no running max",
    "rescaled blocks": "scores not provably bounded (or a float mask, a custom mod): the running max",
})


def strategy_reason(P, T, name: str) -> str:
    """Why task ``T`` takes strategy ``name``: what it has, and for the Python loop's strategies why no compiled
    loop took it."""
    why = _TAKES[name]
    if name.startswith("compiled"):
        return why
    return f"{why}; no compiled loop: {_not_compiled(P, T)}"


def _not_compiled(P, T) -> str:
    """The first reason the compiled loops do not take task ``T``."""
    lim, sc = P.limits, T.sc
    if not lim.plain_loop:
        return "the limits turn the compiled loops off (plain_loop=False)"
    if T.gen is not None or T.keep_scale != 1.0 or T.dropout_p > 0:
        return "dropout reads the scores"
    if P.mask is not None:
        return "an attn_mask"
    if sc.kind == "generic":
        return "a custom score mod"
    if P.bm is not None and sc.kind != "none":
        return f"a score mod ({sc.kind}) with a block mask"
    if P.bm is not None and not lim.tile_loop:
        return "the limits turn the tile loop off (tile_loop=False)"
    if T.jit is None:
        return "no fused kernels for this task (QKV_KERNELS=numpy, numba missing, or below kernel_min)"
    if P.plain_gemm is None:
        return "the GEMM provider has no C sgemm, or weights are returned"
    if not T.shift_free:
        return "scores not provably within the shift-free bound"
    return "its tiles would pass MAX_TILE_BYTES" if P.bm is not None else "weights are returned"


# ---------------------------------------------------------------------------------------------- blocks
def _shift_free_block(P, T, step) -> None:
    """One block with ``m_i = 0``: ``S = Q·Kᵀ`` (modded, masked), ``P = exp(S)``, ``l_i += P·1``,
    ``acc += P·V_j`` — written, not added, where nothing was accumulated in these rows yet."""
    _paths.hit(F_SHIFT_FREE)
    r0, r1, j0, j1, kind = step
    g, w, jit = T.g, j1 - j0, T.jit
    rs = slice(r0 * g, r1 * g)                               # the block's rows (all, but on the diagonal)
    s = T.s_flat[:(r1 - r0) * g * w].reshape((r1 - r0) * g, w)
    # nothing accumulated in these rows yet (a Python test on the plan, where `l_i[rs].any()` cost ~16 µs a block)
    fresh = _first_rows(T.added, r0, r1)
    # (Bq, E) x (E, bk) -> (Bq, bk), modded, masked; p = exp(s − 0)
    plan = T.sc(s, T.i0 + r0, T.i0 + r1, j0, j1, kind, fold_col=T.fold_col, fuse=jit is not None)
    lb = T.l_blk[rs]
    if plan is not None:                                     # p = exp(s), row sums, one pass
        _kernels.run(jit, s, lb, plan, bounded=T.bounded and kind in ("full", "causal"), base2=T.base2)
    else:
        _paths.hit(F_NUMPY_BLOCK)
        _exp(s, out=s)                                       # p = exp(s)
    if T.sc.col_exp is not None:                             # ALiBi's column factor e^{c_j}: into V, row sums
        _alibi_fold(T, s, rs, j0, j1)
        return
    if plan is None:
        _mm(s, T.ones[:w], out=lb)                           # (Bq, bk) x (bk,) -> (Bq,) row sums
    _accumulate(T, s, rs, j0, j1, lb, fresh)


def _accumulate(T, s, rs, j0, j1, lb, fresh: bool) -> None:
    """A block's probabilities ``s`` (row sums ``lb``) into the task's state: ``l_i``, then dropout, then
    ``acc``; written, not added, where no earlier block reached these rows (``fresh``)."""
    if fresh:
        T.l_i[rs] = lb                                       # l_i = Σ_j p: the rows' first block
    else:
        T.l_i[rs] += lb                                      # l_i += Σ_j p (the denominator ignores dropout)
    if T.gen is not None:
        _drop(T, s)
    if fresh:
        _mm(s, T.V[j0:j1], out=T.acc[rs])                    # (Bq, bk) x (bk, Ev) -> (Bq, Ev): acc = P·V_j
    else:
        t = T.tmp[rs]
        _mm(s, T.V[j0:j1], out=t)                            # (Bq, bk) x (bk, Ev) -> (Bq, Ev)
        T.acc[rs] += t                                       # acc += P·V_j


def _alibi_fold(T, s, rs, j0, j1) -> None:
    """A shift-free ALiBi block left of its rows whose column term ``c_j`` was not added to the scores:
    ``exp(s + r + c_j) = exp(s + r)·e^{c_j}`` — ``l_i += P·e^c``, ``acc += P·(e^c ∘ V_j)``, a (bk, Ev) pass
    instead of a (Bq, bk) one."""
    _paths.hit(F_ALIBI_FOLD)
    col_exp = T.sc.col_exp
    Vb = T.v_buf[:j1 - j0]
    np.multiply(T.V[j0:j1], col_exp[:, None], out=Vb)        # e^{c_j} ∘ V_j (bk, Ev)
    lb = T.l_blk[rs]
    _mm(s, col_exp, out=lb)                                  # (Bq, bk) x (bk,) -> (Bq,): Σ_j p·e^{c_j}
    T.l_i[rs] += lb
    if T.gen is not None:
        _drop(T, s)
    t = T.tmp[rs]
    _mm(s, Vb, out=t)                                        # (Bq, bk) x (bk, Ev) -> (Bq, Ev)
    T.acc[rs] += t


def _lazy_block(P, T, step) -> bool:
    """One block against the running max as it is: ``P = exp(S − m_i)``; kept (``l_i += P·1``, ``acc += P·V_j``,
    ``m_i`` unchanged) when every row sum stays within ``exp(lazy_bound)``. Returns whether it was kept."""
    r0, r1, j0, j1, kind = step
    g, w, jit = T.g, j1 - j0, T.jit
    rs = slice(r0 * g, r1 * g)
    s = T.s_flat[:(r1 - r0) * g * w].reshape((r1 - r0) * g, w)
    plan = T.sc(s, T.i0 + r0, T.i0 + r1, j0, j1, kind, m=T.m_i[rs], fuse=jit is not None)   # s − m_i
    lb = T.l_blk[rs]
    if plan is not None:
        _kernels.run(jit, s, lb, plan)                       # p = exp(s − m_i) and row sums, one pass
    else:
        _paths.hit(F_NUMPY_BLOCK)
        _exp(s, out=s)                                       # p = exp(s − m_i), m_i unchanged
        _mm(s, T.ones[:w], out=lb)                           # (Bq, bk) x (bk,) -> (Bq,) row sums
    if not np.all(lb <= T.row_limit):                        # grew too much (NaN/inf fail too): the max pass
        return False
    _paths.hit(F_LAZY)
    t = T.tmp[rs]
    _mm(s, T.V[j0:j1], out=t)                                # (Bq, bk) x (bk, Ev) -> (Bq, Ev)
    T.acc[rs] += t                                           # acc += P·V_j
    T.l_i[rs] += lb                                          # l_i += Σ_j p
    return True


def _max_pass_block(P, T, step) -> None:
    """One block with the max pass: ``m_new = max(m_i, rowmax(S))``, ``P = exp(S − m_new)``,
    ``alpha = exp(m_i − m_new)``, ``l_i = alpha·l_i + P·1``, ``acc = alpha·acc + P·V_j``, ``m_i = m_new``."""
    _paths.hit(F_MAX_PASS)
    r0, r1, j0, j1, kind = step
    g, w, jit = T.g, j1 - j0, T.jit
    rs = slice(r0 * g, r1 * g)
    s = T.s_flat[:(r1 - r0) * g * w].reshape((r1 - r0) * g, w)
    plan = T.sc(s, T.i0 + r0, T.i0 + r1, j0, j1, kind, m=T.m_i[rs], fuse=jit is not None)   # s − m_i
    seen_r, lb = T.seen[rs], T.l_blk[rs]
    fresh = not seen_r.any()        # a row without a max has acc = l_i = 0 (its blocks so far allowed no key)
    if plan is not None:                                     # max, shift, exp and row sums in the kernel
        shift = np.empty(len(seen_r), P.cdt)
        hit = np.empty(len(seen_r), np.bool_)
        _kernels.run_max(jit, s, lb, plan, seen_r, shift, hit)
    else:
        _paths.hit(F_NUMPY_BLOCK)
        m_blk = np.maximum.reduce(s, axis=1)                 # relative to the current m_i; −inf if all masked
        hit = np.isfinite(m_blk)
        shift = np.where(seen_r, np.maximum(m_blk, 0.0), np.where(hit, m_blk, 0.0)).astype(P.cdt)   # m_new − m_i
        np.subtract(s, shift[:, None], out=s)
        _exp(s, out=s)                                       # p = exp(s − m_new)
        _mm(s, T.ones[:w], out=lb)                           # (Bq, bk) x (bk,) -> (Bq,) row sums
    if not fresh:
        alpha = np.where(seen_r, np.exp(-shift), 0.0)        # exp(m_i − m_new); nothing yet: 0
        T.acc[rs] *= alpha[:, None]                          # acc = alpha·acc
        T.l_i[rs] *= alpha                                   # l_i = alpha·l_i
    T.m_i[rs] += shift                                       # m_i = m_new
    T.seen[rs] |= hit
    _accumulate(T, s, rs, j0, j1, lb, fresh)


def _bands(P, T, step) -> None:
    """``nb`` bands of h query rows (from task row r0), band b against keys j0 + b·h … + w, shift-free:
    scores, pattern, softcap, exp, row sums and P·V each one call over all bands (strided views)."""
    _paths.hit(F_BANDS)
    _, r0, nb, h, j0, w, (bias, mask) = step
    E, Ev, it, sc, V, K_T = P.E, P.Ev, P.cdt.itemsize, T.sc, T.V, T.K_T
    ast = np.lib.stride_tricks.as_strided
    Qb = T.qs[r0:r0 + nb * h, :E].reshape(nb, h, E)                        # (nb, h, E)
    Kb = ast(K_T[:E, j0:], shape=(nb, E, w), strides=(h * it, K_T.strides[0], it), writeable=False)
    Vb = ast(V[j0:], shape=(nb, w, Ev), strides=(h * V.strides[0], V.strides[0], it), writeable=False)
    s = _scratch(1, nb * h * w, P.cdt).reshape(nb, h, w)
    _mm(Qb, Kb, out=s)                                                      # (nb, h, E) x (nb, E, w)
    jit = RUNTIME.kernels.for_block(P.cdt, s.size, P.limits.kernel_min)
    pat = mask
    if jit is not None and mask is None and bias is not None and sc.cap is None:
        pat, bias = bias, None                                              # ALiBi's bias and mask, in the kernel
    if bias is not None:
        np.add(s, bias, out=s)                                              # ALiBi's bias (and the mask)
    rows = slice(r0, r0 + nb * h)
    if jit is not None and pat is not None and pat.dtype == P.cdt and pat.flags.c_contiguous:
        # softcap, the mask, exp and row sums in one pass (qkv.kernels)
        kind, arg = ("poly", sc.poly_coef) if sc.poly is not None else ("tanh", sc.cap) if sc.cap is not None \
            else ("exp", None)
        lb = np.empty(nb * h, P.cdt)
        _kernels.run_bands(jit, s, lb, kind, arg, pat)
    else:
        if sc.poly is not None:
            _apply_poly(s, sc.poly)
        elif sc.cap is not None:
            np.tanh(s, out=s)
            np.multiply(s, sc.cap, out=s)
        if mask is not None:
            np.add(s, mask, out=s)                                          # −inf where masked
        if jit is not None:                                                 # exp and row sums, one pass
            lb = np.empty(nb * h, P.cdt)
            _kernels.run(jit, s, lb, ("exp", None, sc.zeros[rows], _NO_MASK, 1))
        else:
            _paths.hit(F_NUMPY_BLOCK)
            _exp(s, out=s)
            lb = _mm(s, T.ones[:w])                                         # (nb, h) row sums
    T.l_i[rows] += lb.reshape(-1)                                           # l_i += Σ_j p
    t = _mm(s, Vb)                                                          # (nb, h, w) x (nb, w, Ev)
    T.acc[rows] += t.reshape(-1, Ev)                                        # acc += P·V_j
    T.added.append((r0, r0 + nb * h))               # its rows accumulated (a later block adds to them)


# ---------------------------------------------------------------------------------------------- the task's end
#: One task's setup at a time, whichever worker it runs on. A setup is Python between short passes (copies,
#: Kᵀ, the query rows scaled), each of which gives the GIL back: two workers setting up at once handed it to
#: and fro at every pass, each hand-off a wake-up (23 voluntary context switches an attention call of SmolLM2's
#: prefill, its four setups 0.17 ms each alone, 0.41 ms at once); one waiting here is one wake-up, and its setup
#: then runs beside the other's compiled loop.
_SETUP = threading.Lock()


def _forward_task(P, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed, keys=None):
    """One (head, query block): the online softmax over the key blocks by the first strategy that supports it;
    writes out/lse/weights rows. ``keys=(k0, k1)`` (split-K): only the key blocks starting in k0 … k1, a partial
    result without sinks."""
    with np.errstate(over="ignore", invalid="ignore"):      # overflow is detected and the block redone
        with _SETUP:
            T = _Task(P, idx, i0, i1, block_k, weights, dropout_p, seed, keys)
        _strategy(P, T).run(P, T)
        row_lse = _finish(P, T, out, lse, weights is not None)
        if weights is not None:
            _weights_pass(P, T, row_lse, weights[idx], seed)


def _finish(P, T, out, lse, weights: bool):
    """``output = acc / l_i`` and ``lse = m_i + log l_i`` into the task's rows (sinks merged in first); returns
    the rows' lse (None when nothing needs it)."""
    idx, i0, i1, g, l_i, acc = T.idx, T.i0, T.i1, T.g, T.l_i, T.acc
    jit = RUNTIME.kernels.for_block(P.cdt, (i1 - i0) * g * P.S, P.limits.kernel_min)
    if (jit is not None and T.keys is None and P.sinks is None and not weights
            and out.dtype == acc.dtype):                 # the division and lse in one compiled pass
        _kernels.finish_rows(jit, acc, l_i, T.m_i, P.heads_view(out, idx, i0, i1, g),
                             None if lse is None else P.heads_view(lse[..., None], idx, i0, i1, g)[..., 0])
        return None
    nz = l_i > 0                                             # l_i = 0: a query that may attend to nothing
    inv = np.divide(1.0, l_i, out=np.zeros_like(l_i), where=nz)
    sink = P.sinks is not None and T.keys is None
    rows_out = None                                          # grouped rows: scaled into each head's output
    if g == 1:                                               # straight into the output (unless a sink is
        rows_out = np.empty_like(acc) if sink else out[idx][i0:i1]   # merged in first): one pass
        np.multiply(acc, inv[:, None], out=rows_out)
    row_lse = None
    if lse is not None or P.sinks is not None or T.keys is not None or weights:
        log_l = np.log(l_i, out=np.full_like(l_i, -np.inf), where=nz)
        row_lse = np.where(nz, T.m_i + log_l, -np.inf).astype(P.cdt, copy=False)
    if sink:
        rows_out, row_lse = _merge_sinks(P, T, rows_out, row_lse)
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
    return row_lse


def _merge_sinks(P, T, rows_out, row_lse):
    """The sink is one more key, with no value: a partial result ``out = 0``, ``lse = sink_h``, merged in."""
    _paths.hit(F_SINKS)
    return merge_partials(rows_out, row_lse, np.zeros_like(rows_out), np.full_like(row_lse, P.sinks[T.sc.sh]))


def _weights_pass(P, T, row_lse, w_rows, seed) -> None:
    """The weights' second pass: ``P = exp(S − lse)`` block by block, stored (dropout's keep-mask drawn again
    from the same stream)."""
    _paths.hit(F_WEIGHTS)
    T.gen = _dropout_rng(seed, P.lead, T.idx, T.i0) if T.dropout_p > 0 else None
    sub = np.where(np.isfinite(row_lse), row_lse, np.inf)[:, None]   # fully masked rows: exp(−inf) = 0
    i0 = T.i0
    for r0, r1, j0, j1, kind in T.blocks:
        w = j1 - j0
        s = T.s_flat[:(r1 - r0) * w].reshape(r1 - r0, w)
        T.sc(s, i0 + r0, i0 + r1, j0, j1, kind)
        np.subtract(s, sub[r0:r1], out=s)
        _exp(s, out=s)
        if T.gen is not None:
            keep = T.gen.random(s.shape, dtype=np.float32) >= T.dropout_p
            np.multiply(s, keep, out=s)
            s *= T.keep_scale
        w_rows[i0 + r0:i0 + r1, j0:j1] = s
