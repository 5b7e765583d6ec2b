"""The plan: the problem as the engine sees it, and the blocks each task walks.

:class:`_Problem` holds a call's validated inputs as views per head in the compute dtype, the score mod's plan
(:class:`qkv.backends.tiled.scoring._ModPlan`), what the block mask's mod promises (its traits), and the limits
in force when the call started (``P.limits``, :class:`qkv.backends.tiled.thresholds.Limits`): every block size and
threshold below is read from there. The workers share it read-only (the key/value heads are prepared once
each, under a lock per head).

**The plan.** A forward task is a block of query rows of one head (or of the query heads that share a
key/value head, their rows interleaved); its plan is the list of key blocks it needs, ``(r0, r1, j0, j1,
kind)``, kind "full" (nothing masked), "causal", "mask" (a slice of ``attn_mask``) or ``("grid", ops)``.
Blocks a mask removes entirely are left out: ``is_causal`` by arithmetic — the keys before the rows in full
blocks, the diagonal square split in quadrants down to ``diagonal_min`` rows (``diagonal_min_plain`` in the
compiled loop, where a block costs no Python) so that little of its masked triangle is computed; a boolean
mask by looking at the block; a block mask by its grid of cells — BlockMask's (BLOCK_SIZE²), or for a mod
that knows its block kinds from index ranges, ``grid_cell``² — which a planner covers with rectangles, one
matmul per run of non-empty key cells, rows halved while that is cheaper (``grid_call_cost``): packed
documents stay 1024-row squares, a sliding window goes by cell rows against its run of keys (64 × 576 for
window 512), a causal mask halves towards the diagonal. Consecutive *bands* (a window's cell rows, each as
far on as it is tall, masked alike relative to its corner) are grouped to run batched
(:func:`qkv.backends.tiled.bands._band_groups`).
The backward walks key blocks, the query blocks each needs planned the same way. Plans that depend on the
shapes alone are cached (:func:`qkv.backends.tiled.scoring._cached`), a block mask's with the block mask.

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import threading

import numpy as np

from qkv import _checks
from qkv.core import shapes
from qkv.core.blockmask import EMPTY as _EMPTY, FULL as _FULL, PARTIAL as _PARTIAL
from qkv.compute.kernels import NO_MASK as _NO_MASK
from qkv.compute import kernels as _kernels
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled.thresholds import current_limits
from qkv.engine.backends.tiled.scoring import _ModPlan, _mask_traits

#: exp of anything below this is 0 in float32 and float64 alike; a fully masked row keeps lse = −inf.
_LOG_HEADROOM = 80.0
_src = shapes.source_index


# ---------------------------------------------------------------------------------------------- the problem
@dataclasses.dataclass(frozen=True)
class Cut:
    """What the call's setup decided beyond the inputs (:mod:`qkv.backends.tiled.setup`): the query heads a forward
    task takes (``group``), the scores a block mask's block may hold (``fwd_budget``), the compiled loops' GEMM
    provider (``plain_gemm``, None: they do not run) and key block (``plain_block_k``)."""
    group: int = 1
    fwd_budget: int | None = None
    plain_gemm: object = None
    plain_block_k: int | None = None


class _Problem:
    """Validated inputs as views per head, in the compute dtype; shared read-only by the workers.

    ``limits``: the :class:`qkv.backends.tiled.thresholds.Limits` to plan with (None: those in force now, read
    once — everything the call plans and runs reads ``P.limits``).
    """

    def __init__(self, query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod=None,
                 block_mask=None, sink_logits=None, limits=None, backward=False):
        self.limits = current_limits() if limits is None else limits   # read once: this call's plan
        self.cdt = _checks.compute_dtype(query.dtype)
        self.L, self.E = query.shape[-2:]
        self.S = key.shape[-2]
        self.Ev = value.shape[-1]
        self.n_rep = shapes.n_rep(query.shape, key.shape, enable_gqa)
        self.lead = shapes.lead(query.shape, key.shape, enable_gqa)
        self.query, self.key, self.value = query, key, value
        self.is_causal = bool(is_causal)
        self.scale = float(scale)
        self.mask = attn_mask
        self.float_mask = attn_mask is not None and attn_mask.dtype != np.bool_
        self.mod = _ModPlan(score_mod)
        if self.mod.slopes is not None and self.lead and self.lead[-1] > self.mod.slopes.size:
            self.mod.kind, self.mod.slopes, self.mod.cap = "generic", None, None   # the mod reports it
        self.qscale = self.scale / self.mod.qdiv             # folded into Q once (softcap: 1/cap too)
        self.bm = block_mask
        if block_mask is not None:
            block_mask.check_sizes(self.lead, self.L, self.S)
            self.bs = int(block_mask.BLOCK_SIZE)
            # the engine's cells: BLOCK_SIZE, or finer (grid_cell) when the mask mod knows its block kinds
            # from index ranges (the built-ins): a window's band then wastes half as much
            self.cell = self.bs
            cell = self.limits.grid_cell_backward if backward else self.limits.grid_cell
            if self.bs > cell and self.bs % cell == 0 and _block_kinds_known(block_mask.mask_mod):
                self.cell = cell
            self.mask_traits = _mask_traits(block_mask.mask_mod)   # what it promises (qkv.mods.MaskTraits)
        self.sinks = None if sink_logits is None else np.asarray(sink_logits, np.float64).reshape(-1)
        # ALiBi with scores that cannot exceed the diagonal's: every allowed key is at or before its query
        # (bias ≤ 0) and every query's own key is allowed (bias 0), so the shift-free bound still holds.
        diag_ok = self.L <= self.S and attn_mask is None
        if block_mask is not None:
            t = self.mask_traits
            self.alibi_causal = diag_ok and t.diagonal and (t.causal or self.is_causal)
        else:
            self.alibi_causal = diag_ok and self.is_causal
        self._kv: dict = {}
        self._kv_lock = threading.Lock()
        self._kv_locks: dict = {}
        self._bm_cache = RUNTIME.plans(block_mask) if block_mask is not None else None
        self.cut = Cut()                                     # how the call is cut: set by with_cut, never in place

    def with_cut(self, cut: "Cut") -> "_Problem":
        """This problem as cut by ``cut`` (:mod:`qkv.backends.tiled.setup` decides it): a shallow copy — the inputs,
        their prepared key/value heads and the caches shared; this one untouched."""
        got = copy.copy(self)
        got.cut = cut
        return got

    @property
    def group(self) -> int:
        """Forward: the query heads per task (grouped-query heads interleaved; 1: one head a task)."""
        return self.cut.group

    @property
    def fwd_budget(self):
        """Forward: the scores a block mask's block may hold (None: ``block_k`` was given)."""
        return self.cut.fwd_budget

    @property
    def plain_gemm(self):
        """The GEMM provider of the compiled loops (None: they do not run)."""
        return self.cut.plain_gemm

    @property
    def plain_block_k(self):
        """The compiled loops' key block (None: the call's ``block_k``)."""
        return self.cut.plain_block_k

    @property
    def plain_scores(self) -> bool:
        """No score mod, no mask, no block mask: the scores are the products alone (but the causal diagonal) —
        the problems whose blocks the compiled loops take (the forward also needs no weights, no dropout)."""
        return self.mod.kind == "none" and self.mask is None and self.bm is None

    @property
    def mod_loop(self) -> bool:
        """ALiBi (causal, the diagonal allowed: as plain scores), a softcap or both, and no mask, no block mask: the
        mods the compiled loop carries (:func:`qkv.kernels.run_mods`; a forward task also needs no weights, no
        dropout, the kernels, a C sgemm and its scores bounded — shift-free)."""
        kind = self.mod.kind
        return (self.mask is None and self.bm is None and self.limits.plain_loop
                and (kind in ("softcap", "alibi_softcap") or (kind == "alibi" and self.alibi_causal)))

    def tile_loop_allowed(self, alone: bool) -> bool:
        """Whether this block-mask problem's tasks may run in the compiled loop with tiles
        (:func:`qkv.backends.tiled.sparse.masked_plan`): no score mod, no ``attn_mask``, nothing but the output
        reads the scores (``alone``: no weights, no dropout) and the limits allow the compiled loops. A task
        then also needs its scores bounded (shift-free), the kernels and a C sgemm."""
        lim = self.limits
        return (self.bm is not None and self.mask is None and self.mod.kind == "none" and alone and lim.plain_loop
                and lim.tile_loop)

    # leading index of the key/value head serving query lead index ``idx``
    def kv_index(self, idx: tuple) -> tuple:
        return shapes.kv_index(idx, self.n_rep)

    def bh(self, idx: tuple) -> tuple:
        """``(b, h)`` of lead index ``idx``: the flattened batch index and the head (as :func:`qkv.pipeline.indices`)."""
        if not self.lead:
            return 0, 0
        b = int(np.ravel_multi_index(idx[:-1], self.lead[:-1])) if len(self.lead) > 1 else 0
        return b, int(idx[-1])

    def kv(self, idx: tuple):
        """``(K, V, k_norm_max, v_abs_max, K_T_ext)`` for the key/value head of ``idx``, once per head.

        K (S, E), V (S, Ev) contiguous in the compute dtype; K_T_ext = [Kᵀ; 1] (E+1, S), contiguous rows
        :data:`KT_PAD` elements apart (:func:`_kt_buffer`),
        its row of ones multiplying the extra column of the query block (−m_i, and ALiBi's row term: the
        running max and the bias folded into the matmul).
        """
        kv_idx = self.kv_index(idx)
        src = (_src(kv_idx, self.key.shape[:-2]), _src(kv_idx, self.value.shape[:-2]))
        got = self._kv.get(src)
        if got is None:
            with self._kv_lock:                  # one lock per head: workers prepare different heads at once
                lock = self._kv_locks.setdefault(src, threading.Lock())
            with lock:
                got = self._kv.get(src)
                if got is None:
                    k = np.ascontiguousarray(self.key[src[0]], dtype=self.cdt)                # (S, E)
                    v = np.ascontiguousarray(self.value[src[1]], dtype=self.cdt)              # (S, Ev)
                    k_t = _kt_buffer(self.E, self.S, self.cdt)                              # (E+1, S)
                    k_norm, v_max = self._kv_prep(k, v, k_t)
                    got = (k, v, k_norm, v_max, k_t)
                    self._kv[src] = got
        return got

    def _kv_prep(self, k: np.ndarray, v: np.ndarray, k_t: np.ndarray) -> tuple:
        """``k_t = [kᵀ; 1]``, the largest norm of k's rows and max |v|: Kᵀ and the norms in one compiled pass
        where the kernels run for a head's keys (:func:`qkv.kernels.kt_prep`), else NumPy's transpose in chunks
        and its norms; V's extent by NumPy's max and min."""
        v_max = float(max(v.max(), -v.min()))
        jit = RUNTIME.kernels.for_block(self.cdt, self.S * self.E, self.limits.kernel_min)
        if jit is not None:
            return math.sqrt(_kernels.kt_prep(jit, k, k_t)), v_max
        for j in range(0, self.S, _KT_CHUNK):                # Q·Kᵀ blocks read contiguous rows
            k_t[:self.E, j:j + _KT_CHUNK] = k[j:j + _KT_CHUNK].T
        k_t[self.E] = 1.0
        return float(np.sqrt(np.einsum("se,se->s", k, k).max())), v_max

    def prepare_kv_split(self, idxs, bounds: list, threads: int) -> None:
        """What :meth:`kv` prepares, for the key/value heads of lead indices ``idxs``, by key ranges ``bounds``
        in parallel (split-K: with few query rows the per-head preparation — copies, Kᵀ, norms — costs as
        much as the attention, and one worker preparing while the others wait would undo the split)."""
        E, S = self.E, self.S
        heads = {}
        for idx in idxs:
            kv_idx = self.kv_index(idx)
            src = (_src(kv_idx, self.key.shape[:-2]), _src(kv_idx, self.value.shape[:-2]))
            if src not in heads and src not in self._kv:
                n = len(bounds) - 1
                heads[src] = (np.empty((S, E), self.cdt), np.empty((S, self.Ev), self.cdt),
                              _kt_buffer(E, S, self.cdt), np.zeros(n), np.zeros(n))

        def fill(src, c):
            k, v, k_t, k_norms, v_maxes = heads[src]
            j0, j1 = bounds[c], min(bounds[c + 1], S)
            if j0 >= j1:
                return
            k[j0:j1] = self.key[src[0]][j0:j1]
            v[j0:j1] = self.value[src[1]][j0:j1]
            for j in range(j0, j1, _KT_CHUNK):              # in chunks, as kv()
                k_t[:E, j:min(j + _KT_CHUNK, j1)] = k[j:min(j + _KT_CHUNK, j1)].T
            k_t[E, j0:j1] = 1.0
            k_norms[c] = np.einsum("se,se->s", k[j0:j1], k[j0:j1]).max()
            v_maxes[c] = max(v[j0:j1].max(), -v[j0:j1].min())
        RUNTIME.run([(src, c) for src in heads for c in range(len(bounds) - 1)], fill, threads)
        with self._kv_lock:
            for src, (k, v, k_t, k_norms, v_maxes) in heads.items():
                self._kv[src] = (k, v, float(np.sqrt(k_norms.max())), float(v_maxes.max()), k_t)

    def q_rows(self, idx: tuple, i0: int, i1: int) -> np.ndarray:
        """Scaled query rows ``Q[i0:i1]·scale`` (Bq, E) in the compute dtype: the scale folded in once (with a
        softcap, ``scale / cap``: the block's tanh then reads its argument straight from the matmul)."""
        q = self.query[_src(idx, self.query.shape[:-2])][i0:i1]
        return np.multiply(q, self.cdt.type(self.qscale), dtype=self.cdt)

    def _group_rows(self, idx: tuple, i0: int, i1: int):
        """The input rows i0 … i1 of the ``group`` query heads from ``idx`` on (views)."""
        if self.group == 1:                              # (also with no lead dimensions: idx = ())
            return [self.query[_src(idx, self.query.shape[:-2])][i0:i1]]
        return [self.query[_src(idx[:-1] + (idx[-1] + h,), self.query.shape[:-2])][i0:i1]
                for h in range(self.group)]

    def q_rows_group(self, idx: tuple, i0: int, i1: int, out: np.ndarray, factor: float = 1.0) -> None:
        """:meth:`q_rows` of the ``group`` query heads from ``idx`` on (they share one key/value head) into
        ``out`` (Bq·group, E), interleaved: row ``r·group + g`` is position ``i0 + r`` of head ``idx[-1] + g`` —
        so that a block of positions is a block of rows, and the scores of all the group's heads come from
        one matmul. Each head's rows are scaled straight into their strided rows of ``out``, by the scale
        times ``factor`` (log₂ e for blocks in base 2), rounded once."""
        g = self.group
        scale = self.cdt.type(self.qscale * factor)
        for h, q in enumerate(self._group_rows(idx, i0, i1)):
            np.multiply(q, scale, out=out[h::g] if g > 1 else out, dtype=self.cdt, casting="unsafe")

    def q_prep(self, idx: tuple, i0: int, i1: int, out: np.ndarray, factor: float):
        """:meth:`q_rows_group` (scale × ``factor``) and :meth:`q_norm_group` in one compiled pass, where it runs
        (the kernels in use for the task's scores, float32 rows): returns the norm, else None (nothing
        written)."""
        jit = RUNTIME.kernels.for_block(self.cdt, (i1 - i0) * self.group * self.S, self.limits.kernel_min)
        if jit is None or self.query.dtype != self.cdt or not out.flags.c_contiguous:
            return None
        q = self.heads_view(self.query, idx, i0, i1, self.group)
        if q is None:
            return None
        m = _kernels.q_prep(jit, q, out, self.cdt.type(self.qscale * factor))
        return None if m is None else math.sqrt(m) * abs(self.qscale)

    def heads_view(self, a: np.ndarray, idx: tuple, i0: int, i1: int, g: int):
        """Rows i0 … i1 of the ``g`` heads from ``idx`` on of ``a`` (…, H, L, ·) — the query (broadcast lead
        dimensions read from their source) or the output — as one (g, rows, ·) view; None where the heads are
        broadcast (a head dimension of 1 with g > 1)."""
        if not idx:
            return a[None, i0:i1]
        src = _src(idx, a.shape[:-2])
        if g > 1 and a.shape[-3] == 1:
            return None
        return a[src[:-1]][src[-1]:src[-1] + g, i0:i1]

    def q_norm_group(self, idx: tuple, i0: int, i1: int) -> float:
        """The largest norm of a scaled query row (``|Q[i]·scale|``) of :meth:`q_rows_group`'s rows, from the
        input rows (so that the scale can take log₂ e in once the shift-free bound is known)."""
        m = 0.0
        for q in self._group_rows(idx, i0, i1):
            if q.size:
                m = max(m, float(np.einsum("le,le->l", q, q, dtype=self.cdt).max()))
        return math.sqrt(m) * abs(self.qscale)

    def mask2d(self, idx: tuple):
        """The mask of head ``idx`` as an (L, S) view (broadcast, never copied), or None."""
        m = self.mask
        if m is None:
            return None
        if m.ndim < 2:
            m = m.reshape((1,) * (2 - m.ndim) + m.shape)
        m = m[_src(idx, m.shape[:-2])]
        return np.broadcast_to(m, (self.L, self.S))

    def shift_free(self, bound: float, log_room: float, slope) -> bool:
        """Whether a query block whose raw scaled scores are within ±``bound`` may run without a running max
        (``m_i = 0``): its modified scores must stay where ``exp`` neither overflows (acc included: below
        ``log_room``) nor underflows a whole row.

        * plain: ``|s| ≤ bound ≤ shift_free_bound`` (the limit);
        * softcap: ``|cap·tanh(s/cap)| < min(cap, bound)`` — bounded whatever the scores, so shift-free
          whenever that bound is below ``log_room`` (≈ 70 for S = 4096: Gemma 2's cap 50 qualifies) and
          ``exp(−bound)`` is a normal float32 (bound ≤ 80); ALiBi under the cap changes nothing;
        * ALiBi: ``s + m·(j − i) ≤ s`` where every allowed key is at or before its query (slope ≥ 0), and the
          query's own key (bias 0, score ≥ −bound) keeps each row's sum above ``exp(−bound)``; so with a
          causal mask that allows the diagonal, as plain. Keys far behind underflow to 0, rightly: their
          weight relative to the diagonal's is below exp(−57), under float32's resolution;
        * a float mask or any other score mod: never (unknown range).
        """
        kind = self.mod.kind
        if self.float_mask or kind == "generic":
            return False
        if kind in ("softcap", "alibi_softcap"):
            u = self.mod.cap if kind == "alibi_softcap" else min(self.mod.cap, bound)
            return u < log_room and u <= _LOG_HEADROOM
        if kind == "alibi" and not (self.alibi_causal and slope is not None and slope >= 0):
            return False
        return bound <= self.limits.shift_free_bound < log_room

    # ------------------------------------------------------------------------------------ block plans
    def key_blocks(self, i0: int, i1: int, mask2d, block_k: int, idx: tuple = (), diagonal_min: int = 0):
        """The blocks query rows i0..i1 need: ``(r0, r1, j0, j1, kind)``, rows i0+r0 … i0+r1 against keys
        j0 … j1, kind "full", "causal", "mask" or ``("grid", ops)`` (a block mask's partial and empty cells).

        Blocks a mask removes entirely are left out; blocks it allows entirely are "full". Causal: the keys
        before i0 in full blocks, then the diagonal square split in quadrants (upper-left and lower-right
        triangles recursively, lower-left full, upper-right skipped) down to the limit ``diagonal_min`` rows,
        so that what is computed and thrown away is n·diagonal_min/2 scores per block of n rows, not n²/2
        (``diagonal_min``: another size, e.g. the compiled loop's ``diagonal_min_plain``)::

            rows ↓  keys →     ■ full   ◣ causal   · skipped
            ■ ■ ■ ◣ ·
            ■ ■ ■ ■ ◣

        With a block mask: :meth:`grid_blocks` (rectangles of its cells).
        """
        if self.bm is not None:
            bs = self.cell
            return [(a0 - i0, a1 - i0, c0, c1, kind) for a0, a1, c0, c1, kind in
                    self.grid_blocks(idx, i0 // bs, -(-i1 // bs), 0, -(-self.S // bs), block_k, self.fwd_budget)]
        S = self.S
        out = []
        if self.is_causal:                 # top-left: row i sees keys j <= i
            full_end = min(i0, S)          # keys every row sees (i0 itself goes with the diagonal block,
            #                                so that every block's width is a multiple of the block sizes)
            for j0 in range(0, full_end, block_k):
                out.append((0, i1 - i0, j0, min(j0 + block_k, full_end), "full"))
            self._diagonal(out, i0, 0, i1 - i0, block_k, diagonal_min or self.limits.diagonal_min)
            return out
        for j0 in range(0, S, block_k):
            j1 = min(j0 + block_k, S)
            kind = _block_kind(mask2d, self.float_mask, i0, i1, j0, j1)
            if kind is not None:
                out.append((0, i1 - i0, j0, j1, kind))
        return out

    def _diagonal(self, out, i0, r0, r1, block_k, smallest):
        """Blocks of the causal square rows i0+r0 … i0+r1 × keys i0+r0 … i0+r1 (clipped at S), halved down to
        ``smallest`` rows."""
        a, b = i0 + r0, min(i0 + r1, self.S)               # its keys
        if a >= b:
            return
        n = r1 - r0
        if n <= smallest:
            for j0 in range(a, b, block_k):
                out.append((r0, r1, j0, min(j0 + block_k, b), "causal"))
            return
        h = r0 + n // 2
        self._diagonal(out, i0, r0, h, block_k, smallest)  # upper-left triangle
        mid = min(i0 + h, self.S)
        for j0 in range(a, mid, block_k):                   # lower-left square: every key is before the rows
            out.append((h, r1, j0, min(j0 + block_k, mid), "full"))
        self._diagonal(out, i0, h, r1, block_k, smallest)  # lower-right triangle

    def backward_blocks(self, idx: tuple, j0: int, j1: int, block_q: int):
        """The blocks key columns j0..j1 need in the backward: ``(i0, i1, c0, c1, kind)`` (absolute rows and
        columns), walking the query blocks; kinds as :meth:`key_blocks`."""
        L = self.L
        if self.bm is not None:
            bs = self.cell
            out = []
            step = max(1, block_q // bs)
            c0, c1 = j0 // bs, -(-j1 // bs)
            for g0 in range(0, -(-L // bs), step):
                out += self.grid_blocks(idx, g0, min(g0 + step, -(-L // bs)), c0, c1, j1 - j0, backward=True)
            return out
        mask2d = self.mask2d(idx)
        out = []
        i_start = j0 if self.is_causal else 0              # causal: rows i < j0 see none of these keys
        for i0 in range(i_start - i_start % block_q, L, block_q):
            i1 = min(i0 + block_q, L)
            if self.is_causal:
                kind = "full" if i0 >= j1 - 1 else "causal"
            else:
                kind = _block_kind(mask2d, self.float_mask, i0, i1, j0, j1)
                if kind is None:
                    continue
            out.append((i0, i1, j0, j1, kind))
        return out

    def grid(self, idx: tuple):
        """The cells of the block mask for head ``idx``: ``(G, nonempty_runs, masked_runs)``.

        ``G`` (⌈L/bs⌉, ⌈S/bs⌉) int8: −1 empty (skipped), 0 full (never masked), else a bit set of what masks
        the cell: 1 the mask mod, 2 ``is_causal``, 4 ``attn_mask``. Per cell row, the runs of non-empty cells
        ``(c0, c1)`` and of equal non-zero values ``(c0, c1, value)``, which the planner works from. Built once
        per block mask, (b, h) of it, ``is_causal`` and whether there is an ``attn_mask`` — kept with the
        block mask across calls (a few hundred KB even at L = S = 65536).
        """
        b, h = self.bh(idx)
        key = ("grid", self.cell, self.is_causal, self.mask is not None, self.bm._bh(b, h))
        got = self._bm_cache.get(key)
        if got is None:
            k = self.bm.kinds[self.bm._bh(b, h)]                             # (nq, nk) EMPTY/PARTIAL/FULL
            if self.cell != self.bs:
                k = self._fine_kinds(k, b, h)
            g = np.where(k == _EMPTY, -1, np.where(k == _PARTIAL, 1, 0)).astype(np.int8)
            if self.is_causal:
                bs = self.cell
                q0 = np.arange(k.shape[0])[:, None] * bs
                q1 = np.minimum(q0 + bs, self.L)
                k0 = np.arange(k.shape[1])[None, :] * bs
                k1 = np.minimum(k0 + bs, self.S)
                any_, all_ = (q1 - 1) >= k0, q0 >= k1 - 1
                g = np.where(any_, g, -1).astype(np.int8)
                g = np.where((g >= 0) & ~all_, g | 2, g).astype(np.int8)
            if self.mask is not None:
                g = np.where(g >= 0, g | 4, g).astype(np.int8)
            got = (g,) + _row_runs(g)
            self._bm_cache[key] = got
        return got

    def _fine_kinds(self, coarse: np.ndarray, b: int, h: int) -> np.ndarray:
        """The block kinds at the engine's finer cells, from the mask mod's own ``block_kinds`` (exact for the
        built-ins), never non-empty where the block mask's cell is empty."""
        c, L, S, f = self.cell, self.L, self.S, self.bs // self.cell
        q0 = (np.arange(-(-L // c), dtype=np.int64) * c)[:, None]
        k0 = (np.arange(-(-S // c), dtype=np.int64) * c)[None, :]
        any_, all_ = (np.asarray(a, dtype=bool) for a in
                      self.bm.mask_mod.block_kinds(q0, np.minimum(q0 + c, L), k0, np.minimum(k0 + c, S)))
        kinds = np.where(all_, _FULL, np.where(any_, _PARTIAL, _EMPTY)).astype(np.int8)
        while kinds.ndim < 4:
            kinds = kinds[None]
        bb, hh = (int(x) for x in self.bm.index_arrays(b, h))
        kinds = kinds[bb if kinds.shape[0] > 1 else 0, hh if kinds.shape[1] > 1 else 0]
        up = np.repeat(np.repeat(coarse == _EMPTY, f, 0), f, 1)[:kinds.shape[0], :kinds.shape[1]]
        return np.where(up, _EMPTY, kinds).astype(np.int8)

    def grid_blocks(self, idx: tuple, g0: int, g1: int, c0: int, c1: int, max_width: int, budget=None,
                    backward: bool = False):
        """Rectangles covering the non-empty cells of cell rows g0..g1 × cell columns c0..c1 of :meth:`grid`,
        each ``(a0, a1, j0, j1, kind)`` in rows and keys, ``kind`` "full" or ``("grid", ops)`` with ops
        ``(a0, a1, j0, j1, value)`` for the runs of masked (value > 0) or empty (−1) cells inside it.

        Each non-empty cell is computed once; empty cells only where a rectangle spans rows of different
        reach. The rows are halved while that is cheaper by the cost model: a rectangle costs its cells plus
        ``grid_call_cost`` cells' worth of per-call overhead (one matmul per run of columns). Documents stay
        whole 1024-row squares, a sliding window goes by cell rows (BLOCK_SIZE queries against the window's
        run of keys), a causal mask halves towards the diagonal as ``is_causal``'s quadrants do. Runs wider
        than ``max_width`` keys, or than ``budget`` scores per block (at least one cell), are cut. Plans are
        kept with the block mask (a training loop plans once).
        """
        call_cost = self.limits.grid_call_cost_backward if backward else self.limits.grid_call_cost
        key = ("plan", self.cell, self.is_causal, self.mask is not None, self.bm._bh(*self.bh(idx)), g0, g1, c0, c1,
               max_width, budget, call_cost)
        got = self._bm_cache.get(key)
        if got is None:
            got = self._grid_blocks(self.grid(idx), g0, g1, c0, c1, max_width, budget, call_cost)
            self._bm_cache[key] = got
        return got

    def _grid_blocks(self, grid, g0, g1, c0, c1, max_width, budget, call_cost):
        _, ne_runs, nz_runs = grid
        bs, L, S = self.cell, self.L, self.S
        out = []
        for ra, rb, ca, cb in _plan_rects(ne_runs, g0, g1, c0, c1, call_cost):
            a0, a1 = ra * bs, min(rb * bs, L)
            width = max_width if budget is None else min(max_width, budget // (a1 - a0))
            step = max(1, width // bs)
            for cs in range(ca, cb, step):
                ce = min(cs + step, cb)
                j0, j1 = cs * bs, min(ce * bs, S)
                ops = []
                for r in range(ra, rb):
                    for s0, s1, v in nz_runs[r]:
                        if s1 > cs and s0 < ce:
                            ops.append((r * bs, min((r + 1) * bs, L), max(s0, cs) * bs, min(min(s1, ce) * bs, S), v))
                out.append((a0, a1, j0, j1, ("grid", ops) if ops else "full"))
        return out


# ---------------------------------------------------------------------------------------------- cells
#: The padding of Kᵀ's rows (elements): rows ``S + KT_PAD`` apart, not ``S``. A ``Q·Kᵀ`` block reads a few
#: columns of all E rows of Kᵀ; at a power-of-two S (4096, 8192) those rows are a multiple of 4 KiB apart and
#: fall into the same sets of the L1 cache, so the GEMM's packing of the block misses on every row. 64 bytes
#: more a row spreads them (up to 1.8× the GEMM's rate; benchmarks/RESULTS.md, "The engine's limits").
KT_PAD = 16
#: Kᵀ is written in chunks of this many keys, which stay in cache (all S at once: 1.7× the time).
_KT_CHUNK = 512


def _kt_buffer(E: int, S: int, dtype) -> np.ndarray:
    """An (E+1, S) buffer for ``[Kᵀ; 1]`` whose rows are ``S + KT_PAD`` elements apart (a view)."""
    return np.empty((E + 1, S + KT_PAD), dtype)[:, :S]


def _row_runs(G: np.ndarray) -> tuple:
    """Per row of the cell grid: the runs of non-empty cells ``[(c0, c1), …]`` and of equal non-zero values
    ``[(c0, c1, value), …]`` (from the points where a row changes value; a window's row is 4 runs)."""
    nq, nk = G.shape
    change = np.ones((nq, nk), bool)
    change[:, 1:] = G[:, 1:] != G[:, :-1]
    rows, cols = np.nonzero(change)
    vals = G[rows, cols].tolist()
    split = np.searchsorted(rows, np.arange(nq + 1)).tolist()
    cols = cols.tolist()
    ne_runs, nz_runs = [], []
    for r in range(nq):
        a, b = split[r], split[r + 1]
        ends = cols[a + 1:b] + [nk]
        ne, nz = [], []
        for s0, s1, v in zip(cols[a:b], ends, vals[a:b]):
            if v != 0:
                nz.append((s0, s1, v))
            if v >= 0:
                if ne and ne[-1][1] == s0:
                    ne[-1] = (ne[-1][0], s1)
                else:
                    ne.append((s0, s1))
        ne_runs.append(ne)
        nz_runs.append(nz)
    return ne_runs, nz_runs


def _plan_rects(ne_runs: list, g0: int, g1: int, c0: int, c1: int, call_cost: float) -> list:
    """Rectangles ``(ra, rb, ca, cb)`` of cells covering every non-empty cell of rows g0..g1 × columns
    c0..c1 once (``ne_runs``: each row's runs of non-empty cells): for a range of rows, one rectangle per
    run of columns non-empty in any of them; halved along the rows while the halves cost less (cells +
    call_cost per rectangle)."""
    def union(ra, rb):
        iv = sorted((max(s, c0), min(e, c1)) for r in range(ra, rb) for s, e in ne_runs[r] if e > c0 and s < c1)
        runs = []
        for s, e in iv:
            if runs and s <= runs[-1][1]:
                if e > runs[-1][1]:
                    runs[-1] = (runs[-1][0], e)
            else:
                runs.append((s, e))
        return runs

    def rec(ra, rb):
        runs = union(ra, rb)
        cost = sum((rb - ra) * (e - s) for s, e in runs) + call_cost * len(runs)
        here = [(ra, rb, s, e) for s, e in runs]
        if rb - ra == 1 or not runs:
            return here, cost
        mid = (ra + rb) // 2
        p1, k1 = rec(ra, mid)
        p2, k2 = rec(mid, rb)
        if k1 + k2 < cost:
            return p1 + p2, k1 + k2
        return here, cost
    if g1 <= g0 or c1 <= c0:
        return []
    return rec(g0, g1)[0]


def _block_kinds_known(mod) -> bool:
    """Whether the mask mod classifies blocks from their index ranges (so finer cells cost nothing)."""
    one = np.zeros((1, 1), np.int64)
    try:
        return mod.block_kinds(one, one + 1, one, one + 1) is not None
    except Exception:                                        # noqa: BLE001 — a custom block_kinds that fails
        return False


def _block_kind(mask2d, float_mask: bool, i0: int, i1: int, j0: int, j1: int):
    """How a (non-causal) block [i0:i1, j0:j1] is masked: "full" (nothing masked), "mask" (apply the
    mask's slice), or None (every entry masked: skip the block)."""
    if mask2d is None:
        return "full"
    if float_mask:
        return "mask"
    blk = mask2d[i0:i1, j0:j1]
    return "full" if blk.all() else ("mask" if blk.any() else None)


# ---------------------------------------------------------------------------------------------- tasks
def _aligned(n: int, bs: int) -> int:
    """``n`` rounded down to a multiple of ``bs`` (at least ``bs``)."""
    return max(1, n // bs) * bs


def _rows_per_task(P: _Problem, bq: int, n_heads: int, threads: int) -> int:
    """The forward's query block from ``bq`` positions: at most L, and halved (down to 64) while there are fewer
    than two tasks a worker (few heads)."""
    bq = min(bq, P.L)
    while bq > 64 and n_heads * math.ceil(P.L / bq) < 2 * threads:
        bq //= 2
    return bq


def _task_blocks(P: _Problem, idx, i0, i1, mask2d, block_k, g, keys):
    """A forward task's blocks (:meth:`_Problem.key_blocks`; split-K, ``keys``: those starting in its key range),
    the widest's keys and the tallest's rows."""
    blocks = P.key_blocks(i0, i1, mask2d, block_k, idx)
    if keys is not None:                                     # split-K: this task's share of the blocks
        blocks = [b for b in blocks if keys[0] <= b[2] < keys[1]]
    return (blocks, max((b[3] - b[2] for b in blocks), default=1),
            max((b[1] - b[0] for b in blocks), default=1) * g)


def _first_rows(added: list, r0: int, r1: int) -> bool:
    """Whether no earlier step accumulated into rows r0 … r1 (``added``: the row ranges that did, which this
    one joins)."""
    fresh = not any(a < r1 and r0 < b for a, b in added)
    added.append((r0, r1))
    return fresh


# ---------------------------------------------------------------------------------------------- compiled loops
def _plain_loops(P: _Problem, jit, gemm):
    """Before the tasks: the GEMM provider of the compiled loops where the kernels run (``jit``) and the provider
    has a C sgemm (each loop compiled, or loaded from numba's cache, at its first call), else None."""
    if jit is not None and P.limits.plain_loop and _kernels.plain_available(gemm):
        return gemm
    return None


def _plain_plan(P: _Problem, i0, i1, block_k, g, keys) -> tuple:
    """The blocks of a forward task of plain scores (kinds "full" and "causal") for the compiled loops
    (:func:`qkv.kernels.run_plain`, :func:`qkv.kernels.run_plain_lazy`), as rows ``(r0, r1, j0, j1, d, fresh)``:
    rows of ``qs`` (positions × ``g``), keys, the causal diagonal's offset (the kernels' ``d``) and whether no
    earlier block accumulated into these rows (its P·V is then written, not added; the lazy loop tests its rows'
    maxima instead). A causal diagonal in squares of ``diagonal_min_plain`` rows. Returns ``(plan, room)``: ``room``
    the largest block's scores (rows × keys), the scratch the loop needs."""
    blocks = P.key_blocks(i0, i1, None, block_k, diagonal_min=P.limits.diagonal_min_plain)
    if keys is not None:
        blocks = [b for b in blocks if keys[0] <= b[2] < keys[1]]
    rows = [(r0, r1, j0, j1, i0 + r0 - j0 if kind == "causal" else _NO_MASK) for r0, r1, j0, j1, kind in blocks]
    plan = _banded(P, rows, g)
    return plan, int(((plan[:, 1] - plan[:, 0]) * (plan[:, 3] - plan[:, 2])).max(initial=1))


def _banded(P: _Problem, blocks, g: int) -> np.ndarray:
    """``blocks`` ``(r0, r1, j0, j1, d)`` (positions, keys, the causal diagonal's offset or NO_MASK) cut into
    pieces within row bands of ``band_rows_plain`` positions and at most ``band_keys_plain`` keys wide (pieces
    the diagonal masks whole left out), band by band, as the compiled loops' plan rows ``(r0·g, r1·g, j0, j1, d,
    fresh)``. In a band the tallest pieces go first: the blocks' rows are nested or apart (halvings), so a
    piece's rows are then either all new (``fresh``: its P·V written) or all seen. (A block mask's tile loop
    plans its own: :mod:`qkv.backends.tiled.sparse`.)"""
    bh, bw = max(1, P.limits.band_rows_plain), max(1, P.limits.band_keys_plain)
    out = []
    for r0, r1, j0, j1, d in blocks:
        a = r0
        while a < r1:
            b = min((a // bh + 1) * bh, r1)
            for c in range(j0, j1, bw):
                e = min(c + bw, j1)
                dd = d if d == _NO_MASK else d + (a - r0) - (c - j0)
                if dd == _NO_MASK or dd + (b - a) > 0:           # (else every row of it before its keys)
                    out.append((a, b, c, e, dd))
            a = b
    out.sort(key=lambda x: (x[0] // bh, x[0] - x[1], x[0], x[2]))
    plan = np.empty((len(out), 6), np.int64)
    added: list = []
    for t, (a, b, c, e, dd) in enumerate(out):
        plan[t] = (a * g, b * g, c, e, dd, _first_rows(added, a, b))
    return plan


def _plain_backward_plan(P: _Problem, idx, j0: int, j1: int, block_q: int) -> np.ndarray:
    """The backward's blocks of keys j0 … j1 for the compiled loop: rows ``(i0, i1, c0, c1, d)``, query rows,
    keys and the causal diagonal's offset (the kernels' ``d``: key c0 + c is allowed for row i0 + r where
    c ≤ d + r). A causal block that straddles the diagonal is split (:func:`_causal_split`) down to squares of
    ``diagonal_min_plain``, so that what is computed and thrown away is not half of it."""
    rows = []
    for i0, i1, c0, c1, kind in P.backward_blocks(idx, j0, j1, block_q):
        if kind == "causal":
            _causal_split(i0, i1, c0, c1, P.limits.diagonal_min_plain, rows)
        else:
            rows.append((i0, i1, c0, c1, _NO_MASK))
    return np.array(rows, np.int64).reshape(-1, 5)


def _causal_split(a: int, b: int, c: int, d: int, smallest: int, out: list) -> None:
    """Rows a … b × keys c … d of a top-left causal mask (row i sees key j ≤ i) as blocks ``(a, b, c, d,
    offset)`` into ``out``: none where no row sees a key, whole ones (offset NO_MASK) where every row sees every
    key, else halved along the longer side down to ``smallest``, where a block carries the diagonal (offset
    a − c)."""
    if b - 1 < c:                                          # every key after every row
        return
    if a >= d - 1:                                         # every key at or before every row
        out.append((a, b, c, d, _NO_MASK))
        return
    if max(b - a, d - c) <= smallest:
        out.append((a, b, c, d, a - c))
        return
    if b - a >= d - c:
        h = a + (b - a) // 2
        _causal_split(a, h, c, d, smallest, out)
        _causal_split(h, b, c, d, smallest, out)
    else:
        h = c + (d - c) // 2
        _causal_split(a, b, c, h, smallest, out)
        _causal_split(a, b, h, d, smallest, out)
