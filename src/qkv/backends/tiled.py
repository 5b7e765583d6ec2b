"""The tiled backend: exact attention in blocks, never the whole ``(L, S)`` score matrix.

Forward (FlashAttention / Rabe & Staats): for a block of queries, walk the key blocks keeping, per query row,
the running max ``m_i``, the running sum ``l_i`` of ``exp(s − m_i)`` and the running weighted sum ``acc`` of
the value rows; when a later block raises the max, rescale ``l_i`` and ``acc`` by ``alpha = exp(m_old − m_new)``.
At the end ``output = acc / l_i`` and ``lse = m_i + log l_i``. Memory is O(block_q · block_k) per worker.

What makes it fast in NumPy, where every elementwise pass over a block costs about a sixth of the block's
matmul, so that a block is, as often as possible, just matmul → exp → matmul:

* ``l_i`` accumulates ``P·1`` (a matrix-vector product, a fifth of the cost of NumPy's row sum; measured
  cheaper too than a column of ones appended to V, which slows the ``P·V`` matmul).
* *Shift-free* query blocks. Softmax is shift invariant; the max is subtracted only so ``exp`` cannot
  overflow. When ``|q_i|·|k_j| ≤ SHIFT_FREE_BOUND`` for every pair (Cauchy–Schwarz bounds every scaled score
  by the product of the norms), ``exp(s)`` can neither overflow nor underflow, so the query block runs with
  ``m_i = 0``: no max pass, no subtraction, no rescaling.
* *Lazy rescaling* otherwise (large scores, float masks). ``−m_i`` is a column of the query block and the
  keys get a row of ones, so the matmul itself yields ``s − m_i``; a block is exponentiated against the
  ``m_i`` it finds, and only when its row sums (the ones column again) pass ``exp(LAZY_BOUND)`` — or a row
  has not seen an allowed key yet — is it redone with a max pass that raises ``m_i`` and rescales ``acc``
  by ``alpha = exp(m_old − m_new)``. ``m_i`` is always a max some block attained, so scores far below it
  underflow only where they are negligible.

All three paths give the same numbers up to rounding; the tests drive each.

Blocks that a mask removes entirely are skipped: ``is_causal`` by arithmetic (the diagonal square split in
quadrants so little of its masked triangle is computed), a boolean mask by looking at the block (``any`` /
``all`` over a slice of the broadcast mask — masks from :mod:`qkv.masks`, causal or sliding window, skip their
empty blocks this way); a block the mask allows entirely is not masked at all.

Flex attention (:func:`qkv.flex_attention`'s score mods, block masks and sinks), block by block, never an
``(L, S)`` bias or mask array:

* *Block masks*: the engine's blocks are rectangles of cells — BlockMask's (BLOCK_SIZE²), or for a
  built-in mod, which knows its kinds from index ranges, GRID_CELL² (64) — and the grid of kinds is all
  that is looked at. Per query block (a multiple of BLOCK_SIZE rows) a planner covers the non-empty cells
  with rectangles — one matmul per run of non-empty key cells, rows halved while that is cheaper
  (GRID_CALL_COST): packed documents stay 1024-row squares, a sliding window goes by cell rows against its
  run of keys (64 × 576 for window 512; consecutive bands run batched, :func:`_bands`), a causal mask
  halves towards the diagonal.
  Empty cells are skipped, full cells never masked, partial cells masked with −inf by the mask mod — or,
  for a mod that depends on ``i − j`` alone (causal, sliding window, their and/or), by a 0/−inf pattern
  cached per offset (the same few recur every block).
* *Score mods* on the scaled scores of each block, ``b``/``h`` the flattened batch and head indices. The
  built-ins get folds: **ALiBi** ``m·(j − i) = m·(j − ρ) + m·(ρ − i)`` — the row term rides in the matmul
  (the extra query column), the column term is one broadcast add, and a block that straddles the diagonal
  adds a cached bias pattern; **softcap** folds ``1/cap`` into the query scale, so a block is matmul → tanh
  → ×cap → exp, with a fitted polynomial instead of tanh in float32 when the block's bound allows
  (:func:`_tanh_poly`); any other mod is called on the block (:func:`qkv.mods.call_score_mod`).
  Shift-free stays where the modded scores are provably bounded (softcap by its cap; ALiBi under a causal
  mask that allows the diagonal: bias ≤ 0 and 0 on the diagonal); otherwise lazy rescaling, ALiBi's blocks
  taken largest bias first so the running max is rarely raised.
* *Sinks*: a sink is one more key with no value, so at the end of a task its rows' ``(out, lse)`` are merged
  with the partial result ``out = 0``, ``lse = sink_h`` (:func:`qkv.merge.merge_partials`, the ring's merge:
  one implementation); the log-sum-exp includes it.

Backward (FlashAttention-2): recompute ``P = exp(S' − lse)`` block by block from the saved log-sum-exp, with
``D_i = rowsum(dO ∘ O)``: ``dV += Pᵀ·dO``, ``dP = dO·Vᵀ``, ``dS' = P ∘ (dP − D_i)``, ``dS = dS' ∘ ∂S'/∂S``
(the score mod's derivative: softcap ``1 − tanh²``, ALiBi 1, a custom mod's ``grad``),
``dK += dSᵀ·Q·scale``, ``dQ += dS·K·scale``; ``d sink_h = −Σ_i exp(sink_h − lse_i)·D_i``. Key blocks are the
parallel unit (their ``dK``, ``dV`` belong to one worker; a block mask planned per key block and query
chunk as in the forward); ``dQ`` is summed from per-task partials.

Parallelism: tasks (batch × heads × query blocks forward, key blocks backward) run on a thread pool of
:func:`get_num_threads` workers, each pinned to its own CPU; NumPy releases the GIL inside matmul and ufunc
loops. While workers run, BLAS is limited to one thread each (``threadpoolctl``, from the ``fast`` extra;
without it BLAS keeps its own setting) so the cores are not oversubscribed. Tasks too small to pay for the
GIL hand-offs (SERIAL_BELOW_FLOPS) run on the calling thread. *Split-K* (flash-decoding): a problem with
fewer (head, query block) tasks than workers — decoding, few query rows against many keys — has its key
range split among the workers, each part returning ``(out, lse)``, merged by log-sum-exp
(:func:`qkv.merge.merge_partials`).

*Grouped-query* heads without masks, mods or sinks: a task takes the query heads that share a key/value head,
their rows interleaved (row ``r·g + h`` is position ``r`` of head ``h``), so a block of positions is one matmul,
one exp and one row pass for the group (:data:`GROUP_GQA`).

With the ``jit`` extra (numba), a block's elementwise steps after ``Q·Kᵀ`` — softcap, the causal diagonal's
mask, the shift −m_i, ``exp`` and the row sums — run as one compiled pass (:mod:`qkv.kernels`): the scorer
leaves them undone and returns the plan (``_Scorer.__call__(…, fuse=True)``). Without it, NumPy's passes.
Shift-free blocks of unmodified scores that nothing reads again run in base 2: log₂ e is folded into the
query rows once, so the block holds ``score·log₂ e`` and the kernel's exponential is 2^s (a third cheaper).

*The compiled loop of plain blocks* (:data:`PLAIN_LOOP`): where a task's blocks are nothing but products,
exponentials and row sums — no mod, no mask but the causal one, no weights or dropout — the whole task's
loop runs in numba (:func:`qkv._jit.plain_rows` shift-free, in base 2; :func:`qkv._jit.plain_lazy_rows` with the
lazy rescaling), calling the GEMM provider's own C ``sgemm`` (NumPy's
bundled OpenBLAS or MKL, :attr:`qkv.gemm.NumpyGemm.c_sgemm`) on the same buffers, P·V accumulated by the
GEMM's beta; the backward's blocks of such problems likewise, per head and key block
(:func:`qkv._jit.plain_backward_rows`: five products, the three accumulations by beta). Without Python
between the calls a block costs nothing of its own, so a causal diagonal there is split down to squares of
DIAGONAL_MIN_PLAIN (32) rows, the backward's diagonal blocks too (:func:`_causal_split`): 0.75 % of the
computed scores thrown away at N = 4096 where 256-row squares threw 5.9 %, and in the backward (512-row blocks,
where half of each diagonal block was computed for nothing) 1.5 % instead of 20 % at N = 2048. Where the
provider has no C sgemm qkv can find (NumPy built against another BLAS), the Python loop runs.

Every matmul goes through the runtime's GEMM provider (:mod:`qkv.gemm`: NumPy's BLAS, or Intel MKL with
``qkv.set_gemm("mkl")`` / ``"auto"``), on the same buffers and views.

Dropout draws its keep-mask per task from ``SeedSequence([seed, head, block start])`` with ``seed`` taken
from the caller's ``rng``: reproducible for a given ``rng``, shapes and block sizes, whatever the thread
count — but not the same random stream as the reference backend's.

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref

import numpy as np

from .. import _checks
from .. import shapes
from ..gemm import exp as _exp, matmul as _mm  # matmuls and block exps by the runtime's provider (qkv.gemm)
from ..kernels import KERNELS as _KERNELS, NO_MASK as _NO_MASK, run as _krun
from ..kernels import run_bands as _krun_bands, run_max as _krun_max, run_plain as _krun_plain
from ..kernels import run_plain_backward as _krun_plain_backward, run_plain_lazy as _krun_plain_lazy
from .. import kernels as _kernels
from .. import paths as _paths
from ..merge import merge_partials
from ..mods import UNKNOWN as _UNKNOWN_MASK, ScoreTraits as _ScoreTraits
from ..blockmask import EMPTY as _EMPTY, FULL as _FULL, PARTIAL as _PARTIAL
from .base import Backend
from .runtime import RUNTIME, default_num_threads, get_num_threads, set_num_threads  # noqa: F401

#: Default query block of the forward (rows per task) and key block (columns per matmul). Measured on the
#: 2-core test machine (N = 4096, E = 64): large query blocks mean fewer Python steps holding the GIL, which
#: two workers share; 1024 × 512 scores (2 MB) was the fastest of 128…1024 × 512…2048, causal or not.
BLOCK_Q = 1024
BLOCK_K = 512
#: Tasks (one query block of one head) smaller than this many flops run on the calling thread alone: their
#: time is mostly Python steps holding the GIL, and two workers passing it back and forth lose. Measured,
#: 1 vs 2 workers: 2 Mflop tasks (B=32, H=12, N=128, E=32) 25 vs 41 ms; 8 Mflop even; 17 Mflop 3.6 vs 2.9 ms;
#: 67 Mflop 6.0 vs 3.7 ms.
SERIAL_BELOW_FLOPS = 1 << 23
#: Causal diagonal squares are split in quadrants down to this many rows (see _Problem.key_blocks). Measured
#: (2 threads, causal, E = 64, medians, 128 / 256 / 512 taking turns): H = 8, N = 4096: 281 / 267 ms, again
#: 257 (256) / 273 (512); N = 2048: 88 / 82; N = 1024: 30.5 / 26.9 / 26.1; SmolLM2's prefill shapes (9 query
#: heads on 3, L = S = 512): 20.9 / 15.8 / 16.0 — fewer, larger blocks, fewer Python steps under the GIL.
DIAGONAL_MIN = 256
#: …and in the compiled loop of plain blocks (_plain_plan), where a block costs no Python: measured as
#: DIAGONAL_MIN's (Zen 4, one thread, paired turns), 128 against 256 0.95–0.96× the time of a causal
#: forward (N = 4096 H = 2; N = 2048 H = 4), 64 against 128 0.96–0.98×; 32 against 64 1.02–1.04× then, and
#: 0.98–1.00× once the loop's blocks were 256 keys wide, its tasks 2048 rows and base 2's rounding one
#: instruction (causal forward N = 4096 one thread 0.998×, H = 8 two threads 0.998×, SmolLM2's prefill shapes
#: 1.003× at 2048 and 0.979× at 512; backward 0.996× / 0.992×), the scores computed and thrown away halved
#: (1.5 % → 0.75 % of the causal forward's at N = 4096); 16 against 32 1.012×.
DIAGONAL_MIN_PLAIN = 32
#: …whose key blocks are BLOCK_K_PLAIN wide (where no block_k is given and S > BLOCK_K): 1024 × 256 scores
#: (1 MB, L2's size on Zen 4) against BLOCK_K's 2 MB, which the GEMM writes, the exponential rewrites and the
#: P·V product packs from L3. Measured (Zen 4, paired turns, medians of 11–21): one thread, N = 4096 H = 2,
#: 256 against 512 0.97–0.98× (full), 0.97–0.98× (causal); N = 2048 H = 4 0.97×; two threads H = 8 0.97× /
#: 1.00×; 128 as 256. The backward's blocks showed no such gain (512 × 256 0.98×, 256 × 512 0.99–1.00×:
#: noise), and stay. Where all the keys fit one BLOCK_K block they stay one: SmolLM2's prefill shapes (9 query
#: heads on 3, causal, two threads) took 1.02–1.05× the time at S = 512 in two blocks, 1.00× at 1024, 0.92×
#: at 2048.
BLOCK_K_PLAIN = 256
#: …and whose tasks take BLOCK_Q_PLAIN query rows (positions × grouped heads; where no block_q is given), each
#: a compiled loop over blocks of that many rows: a task's own costs (its Python, the query rows' norms and
#: scaling, the output's division) paid half as often, and each product's packed Kᵀ and V block used by twice
#: as many rows.
BLOCK_Q_PLAIN = 2048
_LOG2E = 1.4426950408889634                                 # log₂ e: 2^(s·log₂ e) = e^s
#: Forward (and backward): plain blocks (no mod, no mask but the causal diagonal, nothing else reading the
#: scores) run as one compiled loop per task, its GEMMs by the provider's C sgemm (:func:`_plain_plan`),
#: where numba and that function are there. False: the Python loop always (tests compare the two).
PLAIN_LOOP = True
#: Forward: grouped-query heads (without masks, mods or sinks) run a group per task, rows interleaved.
GROUP_GQA = True
#: Backward: key block (rows of dK/dV per step) and query block.
BLOCK_K_BACKWARD = 512
BLOCK_Q_BACKWARD = 512
#: A query block whose scaled scores are all within ±SHIFT_FREE_BOUND runs without a running max:
#: exp(30) ≈ 1e13 and exp(−30) ≈ 1e−13 are far from float32's overflow (3e38) and underflow (1e−38).
SHIFT_FREE_BOUND = 30.0
#: Lazy rescaling keeps the running max m_i while a block's row sums Σ exp(s − m_i) stay below exp(this).
LAZY_BOUND = 40.0
#: exp of anything below this is 0 in float32 and float64 alike; a fully masked row keeps lse = −inf.
_LOG_HEADROOM = 80.0
#: Block masks: the per-call overhead of one rectangle of cells (a matmul, exp, matmul and their Python
#: steps), in BLOCK_SIZE² cells of work; the planner halves a row range while the halves cost less
#: (see _Problem.grid_blocks).
GRID_CALL_COST = 0.75
#: …and in the backward, whose blocks take five matmuls and more passes each.
GRID_CALL_COST_BACKWARD = 2.0
#: A run of bands is batched up to this many scores at a time. Measured (window 512, N = 8192, H = 4, two
#: threads, least of 9 against the causal forward): one band at a time 0.20×, two 0.19×, four 0.18×, up to
#: 16 (this bound) 0.178× — the GIL is handed over less often.
BAND_GROUP_SCORES = 2 * BLOCK_Q * BLOCK_K
#: The engine's cells when a block mask's mod knows its block kinds (the built-ins): BLOCK_SIZE 128 is
#: refined to 64. Measured (sliding window 512, N = 8192, H = 2, one thread, least CPU time of 11 against
#: the full causal forward, others' jobs running): cells of 128 0.19×, 64 0.175×, 32 0.175–0.18× — a
#: window's band has half-masked cells at both ends, half as wide with finer cells; 32 quadruples the grid
#: for nothing more.
GRID_CELL = 64

# ---------------------------------------------------------------------------------------------- threads
# Worker pools, thread counts and BLAS's limit are process state: they live in qkv.backends.runtime (one
# object, RUNTIME, safe under concurrent callers); the thread-count functions are re-exported here.


# ---------------------------------------------------------------------------------------------- paths
# Every strategy, counted where it runs (qkv.paths): the differential matrix proves it walks each one.
_R = _paths.register
F_PLAIN = _R("forward.plain_loop", "a task's plain blocks in one compiled loop, shift-free, base 2")
F_PLAIN_LAZY = _R("forward.plain_loop_lazy", "a task's plain blocks in one compiled loop, lazy rescaling")
F_BANDS = _R("forward.bands", "a run of a block mask's bands batched into one call per step")
F_SHIFT_FREE = _R("forward.shift_free", "a block with no running max (scores provably bounded)")
F_ALIBI_FOLD = _R("forward.alibi_fold", "ALiBi's column term folded into V and the row sums (shift-free)")
F_LAZY = _R("forward.lazy", "a block exponentiated against the running max it found (lazy rescaling)")
F_MAX_PASS = _R("forward.max_pass", "a block with the max pass: the running max raised, acc rescaled")
F_SPLIT_K = _R("forward.split_k", "the key range split among workers, parts merged by log-sum-exp")
F_SINKS = _R("forward.sinks", "sinks merged into a task's rows as one more key without a value")
F_WEIGHTS = _R("forward.weights", "the weights' second pass, exp(s - lse) stored")
F_GROUP = _R("forward.grouped_heads", "the query heads sharing a key/value head in one task, rows interleaved")
F_DROPOUT = _R("forward.dropout", "a block's keep-mask drawn and applied")
F_NUMPY_BLOCK = _R("forward.numpy_block", "a block's exp and row sums by NumPy's passes (no fused kernel)")
B_PLAIN = _R("backward.plain_loop", "a head's plain blocks of a key block in one compiled loop")
B_BLOCKS = _R("backward.blocks", "the Python loop of backward blocks (P recomputed, five products)")
B_FUSED = _R("backward.fused_exp", "a backward block's mod, mask, shift and exp left to one fused pass")
B_MOD_GRAD = _R("backward.mod_grad", "a backward block through a score mod's derivative")
B_SINKS = _R("backward.sinks", "the sinks' gradient")
S_GENERIC = _R("score.generic", "a score mod the engine knows nothing of, called on the block")
S_ALIBI = _R("score.alibi", "ALiBi as a row term in the product and a column term")
S_ALIBI_PATTERN = _R("score.alibi_pattern", "ALiBi on a block across the diagonal, as a cached pattern")
S_SOFTCAP_POLY = _R("score.softcap_poly", "softcap by the fitted polynomial (float32)")
S_SOFTCAP_TANH = _R("score.softcap_tanh", "softcap by tanh")
M_MASK_MOD = _R("mask.mask_mod", "a block mask's partial cells by calling its mask mod")
M_PATTERN = _R("mask.pattern", "a block mask's partial cells by a cached 0/-inf pattern (i - j mods)")
M_ATTN_MASK = _R("mask.attn_mask", "a block masked by a slice of attn_mask")
M_CAUSAL = _R("mask.causal", "a causal diagonal block masked by NumPy")
del _R

# ---------------------------------------------------------------------------------------------- problem
_src = shapes.source_index


def _mask_traits(mod):
    """The :class:`qkv.mods.MaskTraits` the mask mod declares (the built-ins do), else nothing known:
    ``invariant`` (it depends on ``i − j`` alone: its partial blocks repeat per offset and can be cached),
    ``diagonal`` (it allows every ``(i, i)``), ``causal`` (it allows no ``j > i``)."""
    return getattr(mod, "traits", None) or _UNKNOWN_MASK


def _score_traits(mod):
    """The :class:`qkv.mods.ScoreTraits` the score mod declares (the built-ins do), or None."""
    t = getattr(mod, "traits", None)
    return t if isinstance(t, _ScoreTraits) else None


class _ModPlan:
    """How the engine applies a score mod: ``kind`` is "none", "alibi" (bias folded into the matmul and one
    broadcast add), "softcap" (1/cap folded into the query scale; tanh, × cap), "alibi_softcap"
    (``compose(alibi, softcap)``: both) or "generic" (the mod called on each block)."""

    def __init__(self, score_mod):
        self.mod = score_mod
        self.kind, self.slopes, self.cap = "none", None, None
        if score_mod is None:
            return
        t = _score_traits(score_mod)
        chain = [_score_traits(m) for m in t.chain] if t is not None and t.chain else [t]
        bias = [c is not None and c.bias_slopes is not None for c in chain]   # ALiBi's
        cap = [c is not None and c.cap is not None for c in chain]             # softcap's
        if len(chain) == 1 and bias[0]:
            self.kind, self.slopes = "alibi", np.asarray(chain[0].bias_slopes, np.float64)
        elif len(chain) == 1 and cap[0]:
            self.kind, self.cap = "softcap", float(chain[0].cap)
        elif len(chain) == 2 and bias[0] and cap[1]:
            self.kind = "alibi_softcap"
            self.slopes, self.cap = np.asarray(chain[0].bias_slopes, np.float64), float(chain[1].cap)
        else:
            self.kind = "generic"

    @property
    def qdiv(self) -> float:
        """What the query scale is divided by (softcap folds 1/cap into it)."""
        return self.cap if self.cap is not None else 1.0

    def slope(self, h: int):
        """ALiBi's slope for head ``h`` as the block sees it (divided by the cap when capped), or None."""
        if self.slopes is None or h >= self.slopes.size:
            return None
        return float(self.slopes[h]) / self.qdiv


class _Problem:
    """Validated inputs as views per head, in the compute dtype; shared read-only by the workers."""

    def __init__(self, query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod=None,
                 block_mask=None, sink_logits=None):
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
            # the engine's cells: BLOCK_SIZE, or finer (GRID_CELL) when the mask mod knows its block kinds
            # from index ranges (the built-ins): a window's band then wastes half as much
            self.cell = self.bs
            if self.bs > GRID_CELL and self.bs % GRID_CELL == 0 and _block_kinds_known(block_mask.mask_mod):
                self.cell = GRID_CELL
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
        self._bm_cache = _block_mask_cache(block_mask) if block_mask is not None else None
        self.fwd_budget = None                               # forward: scores per block (see grid_blocks)
        self.group = 1                                       # forward: query heads per task (see forward)
        self.plain_gemm = None                               # the provider of the compiled plain loops (_plain_loops)
        self.plain_block_k = None                            # …and their key block (None: the call's)

    @property
    def plain_scores(self) -> bool:
        """No score mod, no mask, no block mask: the scores are the products alone (but the causal diagonal) —
        the problems whose blocks the compiled loops take (the forward also needs no weights, no dropout)."""
        return self.mod.kind == "none" and self.mask is None and self.bm is None

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

        K (S, E), V (S, Ev) contiguous in the compute dtype; K_T_ext = [Kᵀ; 1] (E+1, S), contiguous rows,
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
                    k_t = np.empty((self.E + 1, self.S), self.cdt)                          # (E+1, S)
                    for j in range(0, self.S, 128):          # Q·Kᵀ blocks read contiguous rows; in
                        k_t[:self.E, j:j + 128] = k[j:j + 128].T   # chunks that stay in cache: 2× faster
                    k_t[self.E] = 1.0
                    v = np.ascontiguousarray(self.value[src[1]], dtype=self.cdt)              # (S, Ev)
                    k_norm = float(np.sqrt(np.einsum("se,se->s", k, k).max()))
                    v_max = float(max(v.max(), -v.min()))
                    got = (k, v, k_norm, v_max, k_t)
                    self._kv[src] = got
        return got

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
                              np.empty((E + 1, S), self.cdt), np.zeros(n), np.zeros(n))

        def fill(src, c):
            k, v, k_t, k_norms, v_maxes = heads[src]
            j0, j1 = bounds[c], min(bounds[c + 1], S)
            if j0 >= j1:
                return
            k[j0:j1] = self.key[src[0]][j0:j1]
            v[j0:j1] = self.value[src[1]][j0:j1]
            for j in range(j0, j1, 128):                    # in chunks that stay in cache, as kv()
                k_t[:E, j:min(j + 128, j1)] = k[j:min(j + 128, j1)].T
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

        * plain: ``|s| ≤ bound ≤ SHIFT_FREE_BOUND``;
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
        return bound <= SHIFT_FREE_BOUND < log_room

    # ------------------------------------------------------------------------------------ block plans
    def key_blocks(self, i0: int, i1: int, mask2d, block_k: int, idx: tuple = (), diagonal_min: int = 0):
        """The blocks query rows i0..i1 need: ``(r0, r1, j0, j1, kind)``, rows i0+r0 … i0+r1 against keys
        j0 … j1, kind "full", "causal", "mask" or ``("grid", ops)`` (a block mask's partial and empty cells).

        Blocks a mask removes entirely are left out; blocks it allows entirely are "full". Causal: the keys
        before i0 in full blocks, then the diagonal square split in quadrants (upper-left and lower-right
        triangles recursively, lower-left full, upper-right skipped) down to DIAGONAL_MIN rows, so that
        what is computed and thrown away is n·DIAGONAL_MIN/2 scores per block of n rows, not n²/2
        (``diagonal_min``: another size than DIAGONAL_MIN, e.g. the compiled loop's DIAGONAL_MIN_PLAIN)::

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
            self._diagonal(out, i0, 0, i1 - i0, block_k, diagonal_min or DIAGONAL_MIN)
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
        GRID_CALL_COST cells' worth of per-call overhead (one matmul per run of columns). Documents stay
        whole 1024-row squares, a sliding window goes by cell rows (BLOCK_SIZE queries against the window's
        run of keys), a causal mask halves towards the diagonal as ``is_causal``'s quadrants do. Runs wider
        than ``max_width`` keys, or than ``budget`` scores per block (at least one cell), are cut. Plans are
        kept with the block mask (a training loop plans once).
        """
        call_cost = GRID_CALL_COST_BACKWARD if backward else GRID_CALL_COST
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


_bm_caches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_bm_caches_lock = threading.Lock()


def _block_mask_cache(block_mask) -> dict:
    """The cell grids and plans the engine derived from ``block_mask``, kept as long as it lives (a block
    mask is built once and reused call after call; so are its plans)."""
    with _bm_caches_lock:
        got = _bm_caches.get(block_mask)
        if got is None:
            got = _bm_caches[block_mask] = {}
        return got


def _block_kind(mask2d, float_mask: bool, i0: int, i1: int, j0: int, j1: int):
    """How a (non-causal) block [i0:i1, j0:j1] is masked: "full" (nothing masked), "mask" (apply the
    mask's slice), or None (every entry masked: skip the block)."""
    if mask2d is None:
        return "full"
    if float_mask:
        return "mask"
    blk = mask2d[i0:i1, j0:j1]
    return "full" if blk.all() else ("mask" if blk.any() else None)


# Patterns that recur block after block, built once: the causal triangle per offset, a translation-invariant
# mask mod's partial cells per offset, ALiBi's bias per (slope, offset). Bounded: cleared past _CACHE_BYTES.
_cache: dict = {}
_cache_bytes = [0]
_CACHE_BYTES = 64 << 20


def _cached(key, build):
    """``build()`` (a tuple holding arrays), kept under ``key``."""
    got = _cache.get(key)
    if got is None:
        got = build()
        size = sum(x.nbytes for x in got if isinstance(x, np.ndarray))
        if _cache_bytes[0] + size > _CACHE_BYTES:
            _cache.clear()
            _cache_bytes[0] = 0
        _cache[key] = got
        _cache_bytes[0] += size
    return got


def _causal_additive(d: int, rows: int, cols: int, dtype) -> np.ndarray:
    """(rows, cols): −inf where key j0 + c is after query i0 + r (``c − r > d = i0 − j0``), 0 elsewhere.

    Added to a scores block (one vectorized ufunc pass). The same few patterns recur for every query block
    (mostly ``d = 0``: the diagonal block), so they are built once and kept. C order, as the scores: adding a
    Fortran-ordered pattern to a C-ordered block is ten times slower.
    """
    def build():
        blocked = np.arange(cols)[None, :] - np.arange(rows)[:, None] > d                # (rows, cols)
        return (np.ascontiguousarray(np.where(blocked, -np.inf, 0.0), dtype=dtype),)
    return _cached(("causal", d, rows, cols, np.dtype(dtype).char), build)[0]


def _alibi_pattern(slope: float, d: int, rows: int, cols: int, dtype, causal: bool) -> np.ndarray:
    """(rows, cols): ALiBi's ``slope·(j − i) = slope·(c − r − d)`` (``d = i0 − j0``), computed in float64 and
    rounded once, as the reference does; with ``causal`` also −inf where ``j > i``. For blocks that straddle
    the diagonal (few offsets recur: the diagonal squares, a window's band)."""
    def build():
        rel = (np.arange(cols)[None, :] - np.arange(rows)[:, None] - d).astype(np.float64)
        pat = slope * rel
        if causal:
            pat[rel > 0] = -np.inf
        return (np.ascontiguousarray(pat, dtype=dtype),)
    return _cached(("alibi", slope, d, rows, cols, np.dtype(dtype).char, causal), build)[0]


def _mod_additive(mod, d: int, rows: int, cols: int, dtype) -> np.ndarray:
    """A translation-invariant mask mod on a (rows, cols) block at offset ``d = i0 − j0`` as 0 / −inf, kept
    per offset: a sliding window's or causal mask's partial cells are the same few patterns every block."""
    def build():
        from ..mods import call_mask_mod
        q = np.arange(rows, dtype=np.int64)[:, None] + d
        kv = np.arange(cols, dtype=np.int64)[None, :]
        m = np.broadcast_to(call_mask_mod(mod, np.zeros((), np.int64), np.zeros((), np.int64), q, kv),
                            (rows, cols))
        return mod, np.ascontiguousarray(np.where(m, 0.0, -np.inf), dtype=dtype)
    got = _cached(("mod", id(mod), d, rows, cols, np.dtype(dtype).char), build)
    if got[0] is not mod:                                    # an id reused by a new mod: rebuild
        _cache.pop(("mod", id(mod), d, rows, cols, np.dtype(dtype).char), None)
        got = _cached(("mod", id(mod), d, rows, cols, np.dtype(dtype).char), build)
    return got[1]


def _apply_block_mask(s, kind, mask2d, i0, i1, j0, j1):
    """Mask the scores block ``s`` (Bq, bk) in place for the kinds "full", "causal", "mask": disallowed →
    −inf, or add the float mask."""
    if kind == "full":
        return
    if kind == "causal":
        _paths.hit(M_CAUSAL)
        np.add(s, _causal_additive(i0 - j0, i1 - i0, j1 - j0, s.dtype), out=s)
        return
    _paths.hit(M_ATTN_MASK)
    blk = mask2d[i0:i1, j0:j1]
    if blk.dtype == np.bool_:
        np.copyto(s, -np.inf, where=~blk)
    else:
        np.add(s, blk, out=s, casting="unsafe")


class _Scorer:
    """The scores of one head's blocks as the softmax needs them: ``score_mod(Q·Kᵀ·scale)``, masked, minus a
    per-row shift — as few passes over the block as the mod allows.

    ``qs`` holds the scaled query rows (from absolute row ``row0``), with an extra column when ``row_col``
    (the forward): that column times K_T's row of ones puts a per-row term into the matmul for free (−m_i,
    ALiBi's row term). Without it (the backward, whose query rows other workers share) a row term is one
    broadcast add.
    """

    def __init__(self, P: _Problem, idx: tuple, qs: np.ndarray, row0: int, K_T: np.ndarray, mask2d,
                 row_col: bool):
        self.P, self.qs, self.row0, self.K_T, self.mask2d, self.row_col = P, qs, row0, K_T, mask2d, row_col
        self.rep = P.group                                    # rows per query position (interleaved heads)
        b, h = P.bh(idx)
        self.kind = P.mod.kind
        self.slope = P.mod.slope(h)
        self.fold_m = self.kind in ("none", "alibi") and row_col
        self.sb, self.sh = np.asarray(b, np.int64), np.asarray(h, np.int64)
        if P.bm is not None:
            self.mb, self.mh = P.bm.index_arrays(b, h)
        self.cap = P.cdt.type(P.mod.cap) if P.mod.cap is not None else None
        self.poly = None                                      # set by the forward when the bound allows
        self.poly_coef = None                                 # …and as the fused kernel's seven coefficients
        self.col_exp = None                                   # see __call__'s fold_col
        self.zeros = np.zeros(qs.shape[0], P.cdt)             # a fused kernel's per-row add, when none

    def use_poly(self, bound: float) -> float:
        """Softcap in float32 with every ``|y| = |s/cap| ≤ bound``: a polynomial instead of ``np.tanh`` when one
        of degree ≤ 6 in y² is about as exact as float32's tanh (see :func:`_tanh_poly`). Returns the factor k the
        caller multiplies the query rows by (y' = y·k, chosen so that the polynomial's top coefficient is ±1:
        one pass fewer), or 1.0 without a polynomial."""
        self.poly = None
        if self.kind != "softcap" or self.P.cdt != np.float32:
            return 1.0
        a = _tanh_poly(bound)
        if a is None:
            return 1.0
        # cap·tanh(y) = cap·y·Σ a_j·y^2j = y'·Σ b_j·y'^2j with b_j = cap·a_j / k^(2j+1)
        n = len(a)
        k = abs(float(self.cap) * a[-1]) ** (1.0 / (2 * n - 1))
        b = [float(self.cap) * a[j] / k ** (2 * j + 1) for j in range(n)]
        self.poly = (-1 if b[-1] < 0 else 1, [np.float32(x) for x in b[:-1]])
        coef = np.zeros(7, np.float32)
        coef[:n - 1] = b[:-1]
        coef[n - 1] = self.poly[0]
        self.poly_coef = coef
        return k

    def __call__(self, s, a0, a1, j0, j1, kind, m=None, grad=None, raw=None, fold_col=False, fuse=False):
        """Fill ``s`` (a1−a0, j1−j0) with the block's modified, masked scores minus ``m`` (per row; None: 0).

        ``fuse`` (float32, no ``grad``): leave what a fused kernel does in one pass — softcap, a causal
        diagonal's mask, the shift ``−m`` — undone, and return the plan for :func:`qkv.kernels.run`.

        ``grad`` (a buffer like ``s``): also compute ∂score_mod/∂s there, returning it (or an array that
        broadcasts to it, or None when it is 1); ``raw`` a second buffer the generic mod's grad needs.
        ``fold_col`` (the shift-free forward): ALiBi's column term of a block left of its rows is not added
        but left in ``self.col_exp`` as ``exp(col_term)`` (≤ 1), for the caller to fold into V and the row
        sums: ``exp(s + r + c_j) = exp(s + r)·e^{c_j}``, a (bk, Ev) pass instead of a (Bq, bk) one.
        """
        self.col_exp = None
        E = self.P.E
        r0, r1 = (a0 - self.row0) * self.rep, (a1 - self.row0) * self.rep
        qs, dt = self.qs, s.dtype
        row_term = col_term = pattern = None
        done_mask = False
        if self.kind in ("alibi", "alibi_softcap"):
            # slope·(j − i) = slope·(j − ρ) + slope·(ρ − i): the column term is added, the row term rides in
            # the matmul. ρ lies between every key and query of a block beside the diagonal, so neither term
            # exceeds the bias itself and rounding is as the reference's; a block that straddles the
            # diagonal takes the bias as one cached pattern (few offsets recur), the causal mask in it.
            if j1 - 1 <= a0 or j0 >= a1 - 1:
                _paths.hit(S_ALIBI)
                rho = j1 - 1 if j1 - 1 <= a0 else j0
                row_term = (self.slope * (rho - np.arange(a0, a1, dtype=np.float64))).astype(dt)
                col_term = (self.slope * (np.arange(j0, j1, dtype=np.float64) - rho)).astype(dt)
            else:
                _paths.hit(S_ALIBI_PATTERN)
                causal = kind == "causal"
                pattern = _alibi_pattern(self.slope, a0 - j0, a1 - a0, j1 - j0, dt, causal)
                done_mask = causal
        fold_m = m is not None and self.fold_m
        if self.row_col and (fold_m or row_term is not None):
            col = qs[r0:r1, E]
            if row_term is None:
                np.negative(m, out=col)
            else:
                col[...] = row_term
                if fold_m:
                    col -= m
            _mm(qs[r0:r1], self.K_T[:, j0:j1], out=s)           # (Bq, E+1) x (E+1, bk): + row term
        else:
            _mm(qs[r0:r1, :E], self.K_T[:E, j0:j1], out=s)        # (Bq, E) x (E, bk) -> (Bq, bk)
            if row_term is not None:
                np.add(s, row_term[:, None], out=s)
        if col_term is not None:
            if fold_col and self.kind == "alibi" and rho == j1 - 1:
                self.col_exp = np.exp(col_term)                   # c_j = slope·(j − ρ) ≤ 0 (slope ≥ 0)
            else:
                np.add(s, col_term, out=s)
        if pattern is not None:
            np.add(s, pattern, out=s)
        g = None
        if self.kind == "generic":                            # any other mod: called on the block, fused or not
            _paths.hit(S_GENERIC)
            g = self._generic(s, a0, a1, j0, j1, grad, raw)
        if fuse:
            return self._plan(s, a0, a1, j0, j1, kind, m, fold_m, done_mask)
        if self.poly is not None:                             # cap·tanh(y) = y'·(b_0 + t·(b_1 + … ± t))
            _paths.hit(S_SOFTCAP_POLY)
            _apply_poly(s, self.poly)
        elif self.cap is not None:                            # the scale was divided by cap: s/cap here
            _paths.hit(S_SOFTCAP_TANH)
            np.tanh(s, out=s)
            if grad is not None:                              # d/ds cap·tanh(s/cap) = 1 − tanh²
                g = np.multiply(s, s, out=grad)
                np.subtract(1, g, out=g)
            np.multiply(s, self.cap, out=s)
        if not done_mask:
            self.mask(s, kind, a0, a1, j0, j1)
        if m is not None and not fold_m:
            np.subtract(s, m[:, None], out=s)
        return g

    def _generic(self, s, a0, a1, j0, j1, grad, raw):
        """A mod the engine knows nothing of, called on the block's scaled scores in place; with ``grad`` its
        derivative there too (``raw`` keeps the scores it is taken at). Returns the derivative or None."""
        from ..mods import call_score_mod, score_mod_grad
        P = self.P
        q_idx = np.arange(a0, a1, dtype=np.int64)[:, None]
        kv_idx = np.arange(j0, j1, dtype=np.int64)[None, :]
        if grad is not None:
            np.copyto(raw, s)
        got = call_score_mod(P.mod.mod, s, self.sb, self.sh, q_idx, kv_idx)
        if got is not s:
            np.copyto(s, got)
        if grad is not None:
            return score_mod_grad(P.mod.mod, raw, self.sb, self.sh, q_idx, kv_idx)
        return None

    def _plan(self, s, a0, a1, j0, j1, kind, m, fold_m, done_mask):
        """The rest of the block for a fused kernel: softcap and the causal mask go into the kernel when the
        mask is none or the causal triangle (the mask must follow the cap, so any other mask — and ALiBi's
        diagonal pattern, which carries it — has the cap applied here first)."""
        defer = not done_mask and kind in ("full", "causal")
        fkind, arg = "exp", None
        if self.cap is not None:
            if defer:
                fkind, arg = ("poly", self.poly_coef) if self.poly is not None else ("tanh", self.cap)
            elif self.poly is not None:
                _paths.hit(S_SOFTCAP_POLY)
                _apply_poly(s, self.poly)
            else:
                _paths.hit(S_SOFTCAP_TANH)
                np.tanh(s, out=s)
                np.multiply(s, self.cap, out=s)
        if not defer and not done_mask:
            self.mask(s, kind, a0, a1, j0, j1)
        d = a0 - j0 if defer and kind == "causal" else _NO_MASK
        if m is not None and not fold_m:
            add = np.negative(m)
        else:
            r0 = (a0 - self.row0) * self.rep
            add = self.zeros[r0:r0 + s.shape[0]]
        return fkind, arg, add, d, self.rep

    def mask(self, s, kind, a0, a1, j0, j1):
        """Mask the block in place: nothing for "full", the causal triangle, the attn_mask slice, or a block
        mask's ops: empty cells → −inf, partial cells → the mask mod (a cached 0/−inf pattern when it
        depends on i − j alone, else evaluated on the cell run)."""
        if self.rep > 1:                                      # interleaved heads: only "full" and "causal"
            if kind == "causal":
                s3 = s.reshape(a1 - a0, self.rep, j1 - j0)
                np.add(s3, _causal_additive(a0 - j0, a1 - a0, j1 - j0, s.dtype)[:, None, :], out=s3)
            return
        if isinstance(kind, str):
            _apply_block_mask(s, kind, self.mask2d, a0, a1, j0, j1)
            return
        P = self.P
        for o0, o1, c0, c1, v in kind[1]:
            sub = s[o0 - a0:o1 - a0, c0 - j0:c1 - j0]
            if v < 0:
                sub.fill(-np.inf)
                continue
            if v & 1:
                mod = P.bm.mask_mod
                if P.mask_traits.invariant:
                    _paths.hit(M_PATTERN)
                    np.add(sub, _mod_additive(mod, o0 - c0, o1 - o0, c1 - c0, s.dtype), out=sub)
                else:
                    from ..mods import call_mask_mod
                    _paths.hit(M_MASK_MOD)
                    allowed = call_mask_mod(mod, self.mb, self.mh, np.arange(o0, o1, dtype=np.int64)[:, None],
                                            np.arange(c0, c1, dtype=np.int64)[None, :])
                    np.copyto(sub, -np.inf, where=~np.broadcast_to(allowed, sub.shape))
            if v & 2:
                np.add(sub, _causal_additive(o0 - c0, o1 - o0, c1 - c0, s.dtype), out=sub)
            if v & 4:
                _apply_block_mask(sub, "mask", self.mask2d, o0, o1, c0, c1)


#: Softcap's polynomial runs over a block this many scores at a time, so that its passes (the chunk, t and p:
#: 768 KB) stay in L2. Measured, one thread, a 1024 × 512 block, least of 40: 0.68 ms in one go, 0.50 ms
#: in chunks of 2^16 (2^14: 0.54, 2^15: 0.50) — against 0.72 ms for the block's exp.
POLY_CHUNK = 1 << 16


def _apply_poly(s: np.ndarray, poly) -> None:
    """``s ← y'·(b_0 + t·(b_1 + … ± t))``, t = y'² (any shape; two scratch buffers of a chunk's size)."""
    if s.ndim == 2 and s.size > POLY_CHUNK and s.shape[0] > 1:
        rows = max(1, POLY_CHUNK // s.shape[1])
        for r in range(0, s.shape[0], rows):
            _apply_poly_chunk(s[r:r + rows], poly)
    else:
        _apply_poly_chunk(s, poly)


def _apply_poly_chunk(s: np.ndarray, poly) -> None:
    n, dt = s.size, s.dtype
    t = _scratch(1, n, dt, "poly_t").reshape(s.shape)
    p = _scratch(1, n, dt, "poly_p").reshape(s.shape)
    sign, bs = poly
    np.multiply(s, s, out=t)                                  # t = y'², y' = y·k (k folded into qs)
    if sign < 0:
        np.subtract(bs[-1], t, out=p)
    else:
        np.add(t, bs[-1], out=p)
    for b in bs[-2::-1]:
        p *= t
        p += b
    np.multiply(s, p, out=s)


#: Softcap's tanh by polynomial up to this bound of |s/cap| (fitted per bound on a grid of 1/32).
TANH_POLY_MAX = 0.75
_tanh_polys: dict = {}


def _tanh_poly(bound: float):
    """Coefficients ``a_k`` with ``tanh(y) ≈ y·Σ a_k·y^2k`` to 2e-8 relative for ``|y| ≤ Y``, ``Y`` the bound
    rounded up to a multiple of 1/32 (None above TANH_POLY_MAX).

    Why: NumPy's float32 tanh costs twice its exp here (about a block's matmul), and softcap's argument is
    bounded per query block (Cauchy–Schwarz, as the shift-free rule), often well inside ±0.75 (Gemma 2's cap
    50 with scores within ±37). tanh(y)/y is even and analytic with its nearest poles at ±iπ/2, so a
    Chebyshev fit in t = y² on [0, Y²] converges fast: 3, 4, 5, 7 terms up to Y = 1/8, 0.3, 1/2, 3/4, the
    Horner steps 5 to 13 cheap passes (the top coefficient scaled to ±1) instead of tanh's one expensive
    one (each pass ≈ 0.07 ms, tanh ≈ 1.5 ms on a 1024 × 512 block here). Measured in float32 against float64, cap·tanh at cap 50: 2.7e-6 vs np.tanh's 2.3e-6 at Y = 1/2,
    4.0e-6 vs 3.7e-6 at Y = 0.7; beyond Y = 3/4 the degree, and float32's cancellation in Horner, grow
    (Y = 0.9: 7 terms, 6.4e-6 vs 4.8e-6), and np.tanh is used.
    """
    if not bound <= TANH_POLY_MAX:
        return None
    Y = max(1, math.ceil(bound * 32)) / 32
    got = _tanh_polys.get(Y)
    if got is None:
        from numpy.polynomial import Polynomial
        for n in range(2, 8):
            x = np.cos(np.pi * (np.arange(n) + 0.5) / n)              # Chebyshev nodes on [0, Y²]
            tn = (x + 1) / 2 * Y * Y
            yn = np.sqrt(tn)
            fit = Polynomial.fit(tn, np.tanh(yn) / yn, n - 1, domain=[0, Y * Y]).convert()
            t = np.linspace(0, Y * Y, 4001)[1:]
            if np.abs(fit(t) * np.sqrt(t) / np.tanh(np.sqrt(t)) - 1).max() < 2e-8:
                got = [float(a) for a in fit.coef]
                break
        _tanh_polys[Y] = got
    return got


def _band_groups(P: _Problem, blocks: list, i0: int, slope, max_scores: int) -> list:
    """The blocks, with runs of *bands* merged: consecutive blocks of the same height h and width w, each
    h rows and h keys further on (a sliding window's cell rows), whose masking is the same relative to the
    block — empty cells, a mask mod that depends on i − j alone, the causal bit — so that one pattern
    (mask, and ALiBi's bias, also a function of j − i) serves them all. A run becomes ``("bands", r0, n, h,
    j0, w, pattern)`` and runs as one batched computation (strided views of Q, Kᵀ, V: no copies), where
    block by block the Python steps of a 128-row band cost a third of its time."""
    out, k, n_b = [], 0, len(blocks)
    inv = P.bm is not None and P.mask_traits.invariant
    while k < n_b:
        r0, r1, j0, j1, kind = blocks[k]
        h, w = r1 - r0, j1 - j0
        sig = _rel_ops(kind, i0 + r0, j0, inv)
        e = k + 1
        if sig is not None:
            while (e < n_b and (e - k + 1) * h * w <= max_scores):
                q0, q1, c0, c1, kd = blocks[e]
                if not (q1 - q0 == h and c1 - c0 == w and q0 == r0 + (e - k) * h and c0 == j0 + (e - k) * h
                        and _rel_ops(kd, i0 + q0, c0, inv) == sig):
                    break
                e += 1
        if e - k >= 2:
            out.append(("bands", r0, e - k, h, j0, w,
                        _band_pattern(P, sig, i0 + r0 - j0, h, w, slope, P.mod.cap is not None)))
        else:
            out.append(blocks[k])
        k = e
    return out


def _rel_ops(kind, a0: int, j0: int, inv: bool):
    """A block's masking relative to its corner, or None when it cannot be shared (attn_mask, a mod that
    is not a function of i − j)."""
    if kind == "full":
        return ()
    if isinstance(kind, str):
        return ("causal",) if kind == "causal" else None
    rel = []
    for o0, o1, c0, c1, v in kind[1]:
        if v > 0 and (v & 4 or (v & 1 and not inv)):
            return None
        rel.append((o0 - a0, o1 - a0, c0 - j0, c1 - j0, v))
    return tuple(rel)


def _band_pattern(P: _Problem, sig: tuple, d: int, h: int, w: int, slope, split: bool):
    """The additive (h, w) patterns of a band at offset ``d = a0 − j0``: ``(bias, mask)`` — ALiBi's
    ``slope·(j − i)`` (float64, rounded once) and −inf where masked, each None when there is none; with
    ``split`` False (no softcap between them) added into one."""
    if not sig and slope is None:
        return None, None

    def build():
        mask = np.zeros((h, w), np.float64)
        if sig == ("causal",):
            mask += _causal_additive(d, h, w, np.float64)
        else:
            for r0, r1, c0, c1, v in sig:
                sub = mask[r0:r1, c0:c1]
                if v < 0:
                    sub[...] = -np.inf
                    continue
                if v & 1:
                    sub += _mod_additive(P.bm.mask_mod, d + r0 - c0, r1 - r0, c1 - c0, np.float64)
                if v & 2:
                    sub += _causal_additive(d + r0 - c0, r1 - r0, c1 - c0, np.float64)
        bias = None
        if slope is not None:
            bias = slope * (np.arange(w)[None, :] - np.arange(h)[:, None] - d).astype(np.float64)
        mask = np.ascontiguousarray(mask, dtype=P.cdt) if sig else None
        bias = None if bias is None else np.ascontiguousarray(bias, dtype=P.cdt)
        if not split and bias is not None and mask is not None:
            bias, mask = np.ascontiguousarray(bias + mask, dtype=P.cdt), None
        return mod, bias, mask
    mod = P.bm.mask_mod
    key = ("bands", id(mod), sig, d, h, w, slope, split, P.cdt.char)
    got = _cached(key, build)
    if got[0] is not mod:                                    # an id reused by a new mod: rebuild
        _cache.pop(key, None)
        got = _cached(key, build)
    return got[1], got[2]


_local = threading.local()


def _scratch(rows: int, cols: int, dtype, name: str = "scores") -> np.ndarray:
    """A (rows, cols) block, reused by each worker thread from task to task and call to call (a few MB
    per thread): a fresh multi-megabyte temporary per block costs its page faults every time (measured: a
    third of the backward's time at N = 512)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < rows * cols or buf.dtype != dtype:
        buf = np.empty(rows * cols, dtype)
        setattr(_local, name, buf)
    return buf[:rows * cols].reshape(rows, cols)


def _dropout_rng(seed, lead, idx, i0):
    flat = int(np.ravel_multi_index(idx, lead)) if lead else 0
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, flat, i0])))


# ---------------------------------------------------------------------------------------------- forward
def _forward_task(P: _Problem, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed, keys=None):
    """One (head, query block): the online softmax over the key blocks; writes out/lse/weights rows.
    ``keys=(k0, k1)`` (split-K): only the key blocks starting in k0 … k1, a partial result without sinks."""
    with np.errstate(over="ignore", invalid="ignore"):      # overflow is detected and the block redone
        _forward_rows(P, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed, keys)


def _task_blocks(P: _Problem, idx, i0, i1, mask2d, block_k, g, keys):
    """A forward task's blocks (:meth:`_Problem.key_blocks`; split-K, ``keys``: those starting in its key range),
    the widest's keys and the tallest's rows."""
    blocks = P.key_blocks(i0, i1, mask2d, block_k, idx)
    if keys is not None:                                     # split-K: this task's share of the blocks
        blocks = [b for b in blocks if keys[0] <= b[2] < keys[1]]
    return (blocks, max((b[3] - b[2] for b in blocks), default=1),
            max((b[1] - b[0] for b in blocks), default=1) * g)


def _forward_rows(P: _Problem, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed, keys=None):
    K, V, k_norm, v_max, K_T = P.kv(idx)                     # (S, E), (S, Ev), (E+1, S)
    E, Ev = P.E, P.Ev
    mask2d = P.mask2d(idx)
    g = P.group                                              # rows per position: g interleaved query heads
    Bq = (i1 - i0) * g
    qs = np.empty((Bq, E + 1), P.cdt)                        # [Q·scale, row term]: scale folded in once
    qs[:, E] = 0.0
    if mask2d is None and P.bm is None:                      # the blocks depend on the shapes alone: made once
        blocks, widest, tallest = _cached(("blocks", P.is_causal, i0, i1, P.S, block_k, g, keys, DIAGONAL_MIN),
                                          lambda: _task_blocks(P, idx, i0, i1, None, block_k, g, keys))
    else:
        blocks, widest, tallest = _task_blocks(P, idx, i0, i1, mask2d, block_k, g, keys)
    # the fused block kernels (qkv.kernels: mask, softcap, shift, exp and row sums in one pass), where in use
    jit = _KERNELS.for_block(P.cdt, tallest * widest)
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
    lazy = not shift_free and dropout_p == 0 and log_room > LAZY_BOUND + 1
    if not shift_free and sc.kind in ("alibi", "alibi_softcap") and sc.slope is not None:
        # the blocks with the largest bias first (the diagonal, for a causal ALiBi): later ones then rarely
        # raise the running max, where in key order every block of a steep head would be redone.
        sl = sc.slope
        blocks = sorted(blocks, key=lambda b: -(sl * (b[3] - 1 - (i0 + b[0])) if sl >= 0
                                                else sl * (b[2] - (i0 + b[1] - 1))))
    row_limit = math.exp(LAZY_BOUND)
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
        plan, room = _cached(("plain", P.is_causal, i0, i1, P.S, pbk, g, keys, DIAGONAL_MIN_PLAIN),
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
            _krun_plain(jit, P.plain_gemm, qs, K_T, V, plan, s_flat, acc, l_i, l_blk, sc.zeros, g)
        else:
            _krun_plain_lazy(jit, P.plain_gemm, qs, K_T, V, plan, s_flat, acc, l_i, m_i, seen, l_blk, sc.zeros, g,
                             lazy, row_limit)
        steps = ()
    if (shift_free and gen is None and P.bm is not None and sc.kind in ("none", "alibi", "softcap", "alibi_softcap")
            and (sc.kind == "none" or sc.slope is not None or sc.cap is not None)):
        steps = _band_groups(P, blocks, i0, sc.slope if sc.kind in ("alibi", "alibi_softcap") else None,
                             BAND_GROUP_SCORES)
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
                _krun(jit, s, l_blk[rs], plan, bounded=plain and kind in ("full", "causal"), base2=base2)
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
                    _krun(jit, s, lb, plan)                  # p = exp(s − m_i) and row sums, one pass
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
                _krun_max(jit, s, l_blk[rs], plan, seen_r, shift, hit)
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


def _plain_loops(P: _Problem, jit, gemm) -> None:
    """Before the tasks: where the kernels run (``jit``) and the GEMM provider has a C sgemm, ``P.plain_gemm`` is
    set, so that plain tasks take the compiled loops (each compiled, or loaded from numba's cache, at its first
    call)."""
    if jit is not None and PLAIN_LOOP and _kernels.plain_available(gemm):
        P.plain_gemm = gemm


def _plain_plan(P: _Problem, i0, i1, block_k, g, keys) -> tuple:
    """The blocks of :func:`_forward_rows`'s plain task (kinds "full" and "causal") for the compiled loops
    (:func:`qkv.kernels.run_plain`, :func:`qkv.kernels.run_plain_lazy`), as rows ``(r0, r1, j0, j1, d, fresh)``:
    rows of ``qs`` (positions × ``g``), keys, the causal diagonal's offset (the kernels' ``d``) and whether no
    earlier block accumulated into these rows (its P·V is then written, not added; the lazy loop tests its rows'
    maxima instead). A causal diagonal in squares of DIAGONAL_MIN_PLAIN rows. Returns ``(plan, room)``: ``room``
    the largest block's scores (rows × keys), the scratch the loop needs."""
    blocks = P.key_blocks(i0, i1, None, block_k, diagonal_min=DIAGONAL_MIN_PLAIN)
    if keys is not None:
        blocks = [b for b in blocks if keys[0] <= b[2] < keys[1]]
    plan = np.empty((len(blocks), 6), np.int64)
    added = []
    for t, (r0, r1, j0, j1, kind) in enumerate(blocks):
        plan[t] = (r0 * g, r1 * g, j0, j1, i0 + r0 - j0 if kind == "causal" else _NO_MASK,
                   _first_rows(added, r0, r1))
    return plan, int(((plan[:, 1] - plan[:, 0]) * (plan[:, 3] - plan[:, 2])).max(initial=1))


def _first_rows(added: list, r0: int, r1: int) -> bool:
    """Whether no earlier step accumulated into rows r0 … r1 (``added``: the row ranges that did, which this
    one joins)."""
    fresh = not any(a < r1 and r0 < b for a, b in added)
    added.append((r0, r1))
    return fresh


def _bands(P: _Problem, qs, K_T, V, r0, nb, h, j0, w, pattern, sc, acc, l_i, ones) -> None:
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
    jit = _KERNELS.for_block(P.cdt, s.size)
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
        _krun_bands(jit, s, lb, kind, arg, pat)
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
        _krun(jit, s, lb, ("exp", None, sc.zeros[r0:r0 + nb * h], _NO_MASK, 1))
    else:
        _paths.hit(F_NUMPY_BLOCK)
        _exp(s, out=s)
        lb = _mm(s, ones[:w])                                               # (nb, h) row sums
    l_i[r0:r0 + nb * h] += lb.reshape(-1)
    t = _mm(s, Vb)                                                          # (nb, h, Ev)
    acc[r0:r0 + nb * h] += t.reshape(-1, Ev)


def _aligned(n: int, bs: int) -> int:
    """``n`` rounded down to a multiple of ``bs`` (at least ``bs``)."""
    return max(1, n // bs) * bs


def forward(query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale, enable_gqa=False,
            rng=None, return_weights=False, return_lse=False, threads=None, block_q=None, block_k=None,
            score_mod=None, block_mask=None, sink_logits=None):
    """The tiled forward on validated arrays; returns ``(output, weights|None, lse|None)``.

    ``output`` (..., Hq, L, Ev) in the input dtype; ``lse`` (..., Hq, L) in the compute dtype (float32 for
    float16/32 inputs), −inf on fully masked rows; ``weights`` (..., Hq, L, S) only when asked for.
    ``score_mod``, ``block_mask``, ``sink_logits``: as :func:`qkv.flex_attention` (see the module doc).
    ``block_q``/``block_k`` override the block sizes (tests use small ones to hit block boundaries); with a
    block mask they are rounded to multiples of its BLOCK_SIZE.
    """
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod, block_mask, sink_logits)
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else BLOCK_Q
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else BLOCK_K
    n_heads = math.prod(P.lead)
    if block_mask is not None:
        bs = P.bs
        bq = min(_aligned(bq, bs), -(-P.L // bs) * bs)
        # the widest run of keys one matmul takes: block_k when given, else as many as keep a block of
        # scores within BLOCK_Q × BLOCK_K numbers (a cell row of 128 queries takes up to 4096 keys at once)
        bk = _aligned(bk, bs) if block_k is not None else _aligned(P.L + P.S, bs)
        P.fwd_budget = None if block_k is not None else BLOCK_Q * BLOCK_K
        while block_q is None and bq > bs and n_heads * math.ceil(P.L / bq) < 2 * threads:
            bq = _aligned(bq // 2, bs)
    else:
        # Grouped-query heads without masks, mods or sinks: one task takes the query heads that share a
        # key/value head together, their rows interleaved (P.q_rows_group) — one matmul, exp and row pass per
        # block for all of them, where each head took its own (a third of the Python steps for 9 query heads
        # on 3, SmolLM2's prefill); the block keeps about as many rows (block_q positions ÷ group).
        if (GROUP_GQA and P.n_rep > 1 and P.lead and P.mod.kind == "none" and attn_mask is None
                and P.sinks is None and dropout_p == 0 and not return_weights):
            P.group = P.n_rep
            n_heads //= P.group
            bq = max(1, bq // P.group) if block_q is None else bq
        bq = _rows_per_task(P, bq, n_heads, threads) if block_q is None else min(bq, P.L)
    gemm = RUNTIME.gemm.active()                             # resolve the GEMM provider here, not in a worker
    jit = _KERNELS.for_call(P.cdt, bq * P.group * min(bk, P.S))   # …and load the fused kernels, if blocks use them
    _plain_loops(P, jit, gemm)
    if P.plain_gemm is not None and P.plain_scores and dropout_p == 0 and not return_weights:   # compiled loops
        if block_k is None and P.S > bk:                     # (keys of one BLOCK_K block stay one block)
            P.plain_block_k = BLOCK_K_PLAIN
        if block_q is None:
            bq = _rows_per_task(P, max(1, BLOCK_Q_PLAIN // P.group), n_heads, threads)
    out = np.empty(P.lead + (P.L, P.Ev), P.cdt)
    lse = np.empty(P.lead + (P.L,), P.cdt) if return_lse else None
    weights = np.zeros(P.lead + (P.L, P.S), P.cdt) if return_weights else None
    if dropout_p > 0 and rng is None:
        rng = np.random.default_rng()
    seed = int(rng.integers(2**63)) if dropout_p > 0 else 0
    starts = list(range(0, P.L, bq))
    if is_causal:
        starts.reverse()                                     # the longest rows first: better balance
    tasks = [(P, idx, i0, min(i0 + bq, P.L), bk, out, lse, weights, dropout_p, seed)
             for i0 in starts for idx in np.ndindex(*P.lead) if not idx or idx[-1] % P.group == 0]
    if block_mask is not None:                               # the most cells first: better balance
        work = {}
        for idx in np.ndindex(*P.lead):
            g = P.grid(idx)[0] >= 0
            work[idx] = [int(g[i0 // P.cell:-(-min(i0 + bq, P.L) // P.cell)].sum()) for i0 in range(0, P.L, bq)]
        tasks.sort(key=lambda t: -work[t[1]][t[2] // bq])
    splits = _key_splits(P, len(tasks), threads, bq, bk, dropout_p, weights is not None)
    if splits > 1:
        return _forward_split(P, tasks, splits, bk, threads, query.dtype, return_lse)
    if 2 * bq * P.group * P.S * (P.E + P.Ev) < SERIAL_BELOW_FLOPS:
        threads = 1
    RUNTIME.run(tasks, _forward_task, threads)
    dt = query.dtype
    return (out.astype(dt, copy=False), None if weights is None else weights.astype(dt, copy=False), lse)


def _rows_per_task(P: _Problem, bq: int, n_heads: int, threads: int) -> int:
    """The forward's query block from ``bq`` positions: at most L, and halved (down to 64) while there are fewer
    than two tasks a worker (few heads)."""
    bq = min(bq, P.L)
    while bq > 64 and n_heads * math.ceil(P.L / bq) < 2 * threads:
        bq //= 2
    return bq


#: Split-K (flash-decoding): with fewer (head, query block) tasks than workers, the key range is split among
#: the workers, each part returning ``(out, lse)``, merged by :func:`qkv.merge.merge_partials`, when there
#: are at least this many key blocks to share…
SPLIT_K_MIN_BLOCKS = 2
#: …and each part gets at least this many keys. Few query rows make the work memory-bound, and a split's fixed
#: costs (the hand-off to the workers, the parts' buffers, the merge) must be paid back: measured on the
#: 2-core test machine (L = 64, one head, 2 workers, others' jobs running), S = 65536 in two parts of 32768
#: was 1.3× slower than unsplit, S = 262144 (parts of 131072) 0.7×.
SPLIT_K_MIN_PART_KEYS = 1 << 16


def _key_splits(P: _Problem, n_tasks: int, threads: int, bq: int, bk: int, dropout_p, weights: bool) -> int:
    """Into how many key ranges each task is split (1: none). Decode-like problems (few query rows, many keys:
    fewer tasks than workers) split so every worker has a share; not with dropout (its mask is drawn per
    task) or weights (a second pass over all keys), and only while each part still pays for a worker
    (SERIAL_BELOW_FLOPS)."""
    if threads <= 1 or n_tasks >= threads or dropout_p > 0 or weights:
        return 1
    splits = min(-(-threads // n_tasks), -(-P.S // bk) // SPLIT_K_MIN_BLOCKS, P.S // SPLIT_K_MIN_PART_KEYS)
    while splits > 1 and 2 * min(bq, P.L) * (P.S / splits) * (P.E + P.Ev) < SERIAL_BELOW_FLOPS:
        splits -= 1
    return max(1, splits)


def _forward_split(P: _Problem, tasks: list, splits: int, bk: int, threads: int, dt, return_lse: bool):
    """Split-K: every task's key range in ``splits`` parts (at key-block boundaries), each part a task
    writing its own ``(out, lse)``; the parts merged by log-sum-exp (:func:`qkv.merge.merge_partials`, the
    ring's merge too), then the sinks merged in as one more part (out = 0, lse = sink)."""
    n_blocks = -(-P.S // bk)
    bounds = [round(n_blocks * c / splits) * bk for c in range(splits + 1)]
    bounds[-1] = max(bounds[-1], P.S)
    outs = np.zeros((splits,) + P.lead + (P.L, P.Ev), P.cdt)
    lses = np.full((splits,) + P.lead + (P.L,), -np.inf, P.cdt)
    parts = [(P, idx, i0, i1, block_k, outs[c], lses[c], None, 0.0, 0, (bounds[c], bounds[c + 1]))
             for c in range(splits) for (_, idx, i0, i1, block_k, *_rest) in tasks]
    P.prepare_kv_split({t[1] for t in tasks}, bounds, threads)
    _paths.hit(F_SPLIT_K)
    RUNTIME.run(parts, _forward_task, threads)
    out, lse = outs[0], lses[0]
    for c in range(1, splits):
        merge_partials(out, lse, outs[c], lses[c], out=(out, lse))
    if P.sinks is not None:
        _paths.hit(F_SINKS)
        sink = np.empty_like(lse)
        for idx in np.ndindex(*P.lead):
            sink[idx] = P.sinks[P.bh(idx)[1]]
        merge_partials(out, lse, np.zeros_like(out), sink, out=(out, lse))
    return out.astype(dt, copy=False), None, lse if return_lse else None


#: ``backend="auto"`` runs the tiled engine when the scores (…, Hq, L, S) would hold at least
#: AUTO_TILED_MIN_SCORES numbers (2 MiB in float32) *and* each head's L·S at least AUTO_TILED_MIN_HEAD_SCORES
#: (≈ 362²). Measured on the 2-core test machine (float32, E = 32…64): with large heads the two are even at
#: about 2^18 scores, the tiled engine 1.4× faster at 2^19 (H=8, N=512) and 3× at 2^23 (H=12, N=1024); with
#: many small heads the tiled engine's per-head work does not pay (B=32, H=12, N=128: 1.4× slower; N=64: 7×),
#: so those, like everything small, take the reference, which is also the observable path.
AUTO_TILED_MIN_SCORES = 1 << 19
AUTO_TILED_MIN_HEAD_SCORES = 1 << 17
#: …and at least this many keys (a key block narrower than this makes thin, inefficient matmuls).
AUTO_MIN_KEYS = 128


class TiledBackend(Backend):
    """The tiled engine as a backend (forward, backward, the size rule of ``backend="auto"``)."""

    name = "tiled"
    features = frozenset({"mask", "causal", "dropout", "weights", "lse", "score_mod", "block_mask", "sinks",
                          "backward", "threads"})

    def prefers(self, query, key, value, *, enable_gqa=False) -> bool:
        per_head = query.shape[-2] * key.shape[-2]
        return (shapes.n_scores(query.shape, key.shape, enable_gqa) >= AUTO_TILED_MIN_SCORES
                and per_head >= AUTO_TILED_MIN_HEAD_SCORES and key.shape[-2] >= AUTO_MIN_KEYS)

    def forward(self, query, key, value, **kw):
        return forward(query, key, value, **kw)

    def backward(self, grad_out, query, key, value, **kw):
        return backward(grad_out, query, key, value, **kw)


TILED = TiledBackend()


def tiled_attention(query, key, value, **kw):
    """The older function form of the tiled backend: ``(output, weights)`` or ``(…, lse)``."""
    return TILED(query, key, value, **kw)


# ---------------------------------------------------------------------------------------------- backward
def _backward_task(P: _Problem, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep):
    """dK, dV of the key blocks ``key_starts`` of one key/value head; dQ into this task's partial."""
    with np.errstate(over="ignore", invalid="ignore"):
        _backward_blocks(P, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep)


def _backward_blocks(P: _Problem, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep):
    K, V, _, _, K_T = P.kv(q_heads[0])
    E, Ev = P.E, P.Ev
    bq, bk = min(block_q, P.L), min(block_k, P.S)
    s_buf = _scratch(1, bq * bk, P.cdt).reshape(-1)          # a block's scores, then P
    dp_buf = _scratch(1, bq * bk, P.cdt, "dp").reshape(-1)   # dP, then dS
    needs_grad = P.mod.kind in ("softcap", "alibi_softcap", "generic")
    g_buf = _scratch(1, bq * bk, P.cdt, "grad").reshape(-1) if needs_grad else None
    raw_buf = _scratch(1, bq * bk, P.cdt, "raw").reshape(-1) if P.mod.kind == "generic" else None
    jit = _KERNELS.for_block(P.cdt, bq * bk)                   # exp(S' − lse) in one pass (qkv.kernels)
    sums = np.empty(bq, P.cdt) if jit is not None else None
    dv_t, dk_t, dq_t = np.empty((bk, Ev), P.cdt), np.empty((bk, E), P.cdt), np.empty((bq, E), P.cdt)
    # No mod, no mask but the causal one: each head's blocks of a key block in one compiled loop
    # (qkv._jit.plain_backward_rows), the same steps as below, the adds done by the GEMMs
    plain = P.plain_gemm is not None and jit is not None and P.plain_scores
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
                plan = _cached(("plain backward", P.is_causal, P.L, P.S, j0, j1, block_q, DIAGONAL_MIN_PLAIN),
                               lambda: (_plain_backward_plan(P, idx, j0, j1, block_q),))[0]
                _krun_plain_backward(jit, P.plain_gemm, qs, do, lse_neg, D, K, K_T, V, plan, j0, j1, s_buf, dp_buf,
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
                use_jit = jit is not None and s.size >= _kernels.KERNEL_MIN
                if use_jit and g_buf is None:                  # mod, causal mask, − lse and exp: one pass
                    _paths.hit(B_FUSED)
                    g = None
                    fk, arg, _, d, rep = sc(s, i0, i1, c0, c1, kind, fuse=True)
                    _krun(jit, s, sums[:m], (fk, arg, lse_neg[i0:i1], d, rep))
                else:
                    g = sc(s, i0, i1, c0, c1, kind,
                           grad=None if g_buf is None else g_buf[:m * n].reshape(m, n),
                           raw=None if raw_buf is None else raw_buf[:m * n].reshape(m, n))
                    if use_jit:
                        _krun(jit, s, sums[:m], ("exp", None, lse_neg[i0:i1], _NO_MASK, 1))
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


def _plain_backward_plan(P: _Problem, idx, j0: int, j1: int, block_q: int) -> np.ndarray:
    """The backward's blocks of keys j0 … j1 for the compiled loop: rows ``(i0, i1, c0, c1, d)``, query rows,
    keys and the causal diagonal's offset (the kernels' ``d``: key c0 + c is allowed for row i0 + r where
    c ≤ d + r). A causal block that straddles the diagonal is split (:func:`_causal_split`) down to squares of
    DIAGONAL_MIN_PLAIN, so that what is computed and thrown away is not half of it."""
    rows = []
    for i0, i1, c0, c1, kind in P.backward_blocks(idx, j0, j1, block_q):
        if kind == "causal":
            _causal_split(i0, i1, c0, c1, DIAGONAL_MIN_PLAIN, rows)
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


_sum_to_shape = shapes.sum_to_shape


def backward(grad_out, query, key, value, *, attn_mask=None, is_causal=False, scale, enable_gqa=False,
             threads=None, block_q=None, block_k=None, out=None, lse=None, score_mod=None, block_mask=None,
             sink_logits=None):
    """Gradients ``(dQ, dK, dV)`` of ``sum(grad_out ∘ attention(query, key, value))``, tiled; with
    ``sink_logits`` also ``d sink_logits`` (Hq,) last.

    ``out``/``lse`` from a previous :func:`forward` (with ``return_lse=True``) skip its recomputation.
    """
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod, block_mask, sink_logits)
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else BLOCK_Q_BACKWARD
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else BLOCK_K_BACKWARD
    if block_mask is not None:
        bq, bk = _aligned(bq, P.bs), _aligned(bk, P.bs)
    if out is None or lse is None:
        out, _, lse = forward(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa, return_lse=True, threads=threads, score_mod=score_mod,
                              block_mask=block_mask, sink_logits=sink_logits)
    out = np.broadcast_to(out, P.lead + (P.L, P.Ev))
    grad_out = np.broadcast_to(grad_out, P.lead + (P.L, P.Ev))
    lead = P.lead
    kv_lead = shapes.kv_lead(lead, P.n_rep)
    dk = np.empty(kv_lead + (P.S, P.E), P.cdt)
    dv = np.empty(kv_lead + (P.S, P.Ev), P.cdt)
    dq = np.zeros(lead + (P.L, P.E), P.cdt)
    n_kv = math.prod(kv_lead)
    key_starts = list(range(0, P.S, bk))
    n_chunks = max(1, min(len(key_starts), math.ceil(threads / n_kv))) if threads > 1 else 1
    prep = {}
    d_sink = None if P.sinks is None else np.zeros(P.sinks.shape, np.float64)
    if d_sink is not None:
        _paths.hit(B_SINKS)
    for idx in np.ndindex(*lead):                           # per query head: Q·scale, dO, −lse, D
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
    tasks, partials = [], []
    for kv_idx in np.ndindex(*kv_lead):
        heads = shapes.query_heads(kv_idx, P.n_rep)
        for c in range(n_chunks):
            part = np.zeros((len(heads), P.L, P.E), P.cdt)
            partials.append((heads, part))
            tasks.append((P, kv_idx, heads, key_starts[c::n_chunks], bq, bk, part, dk, dv, prep))
    if 2 * min(bk, P.S) * P.L * (2 * P.E + 3 * P.Ev) * P.n_rep < SERIAL_BELOW_FLOPS:
        threads = 1
    gemm = RUNTIME.gemm.active()                             # resolve the GEMM provider here, not in a worker
    jit = _KERNELS.for_call(P.cdt, min(bq, P.L) * min(bk, P.S))   # …and load the fused kernels, if blocks use them
    _plain_loops(P, jit, gemm)
    RUNTIME.run(tasks, _backward_task, threads)
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


# ---------------------------------------------------------------------------------------------- limits
@dataclasses.dataclass(frozen=True)
class Limits:
    """The engine's thresholds and block sizes (each field a module constant of the same name, upper case;
    ``kernel_min`` is :data:`qkv.kernels.KERNEL_MIN`). :func:`limits` moves them for the calls inside a block,
    so a test can put every threshold inside a small problem."""
    block_q: int = BLOCK_Q
    block_k: int = BLOCK_K
    block_q_plain: int = BLOCK_Q_PLAIN
    block_k_plain: int = BLOCK_K_PLAIN
    block_q_backward: int = BLOCK_Q_BACKWARD
    block_k_backward: int = BLOCK_K_BACKWARD
    serial_below_flops: int = SERIAL_BELOW_FLOPS
    diagonal_min: int = DIAGONAL_MIN
    diagonal_min_plain: int = DIAGONAL_MIN_PLAIN
    plain_loop: bool = PLAIN_LOOP
    group_gqa: bool = GROUP_GQA
    shift_free_bound: float = SHIFT_FREE_BOUND
    lazy_bound: float = LAZY_BOUND
    grid_call_cost: float = GRID_CALL_COST
    grid_call_cost_backward: float = GRID_CALL_COST_BACKWARD
    band_group_scores: int = BAND_GROUP_SCORES
    grid_cell: int = GRID_CELL
    split_k_min_blocks: int = SPLIT_K_MIN_BLOCKS
    split_k_min_part_keys: int = SPLIT_K_MIN_PART_KEYS
    kernel_min: int = _kernels.KERNEL_MIN
    auto_tiled_min_scores: int = AUTO_TILED_MIN_SCORES
    auto_tiled_min_head_scores: int = AUTO_TILED_MIN_HEAD_SCORES
    auto_min_keys: int = AUTO_MIN_KEYS


def current_limits() -> Limits:
    """The limits in force now."""
    g = globals()
    return Limits(**{f.name: (_kernels.KERNEL_MIN if f.name == "kernel_min" else g[f.name.upper()])
                     for f in dataclasses.fields(Limits)})


_LIMITS_LOCK = threading.Lock()


@contextlib.contextmanager
def limits(**changes):
    """Move the engine's thresholds for the calls inside the block (names: :class:`Limits`' fields), e.g.
    ``with limits(block_q=64, kernel_min=0, split_k_min_part_keys=16): ...``; restored on leaving. One
    block at a time in a process (a second, from another thread, waits)."""
    names = {f.name for f in dataclasses.fields(Limits)}
    bad = sorted(set(changes) - names)
    if bad:
        raise ValueError(f"limits: unknown {', '.join(bad)}; expected some of {', '.join(sorted(names))}")
    with _LIMITS_LOCK:
        old = current_limits()
        new = dataclasses.replace(old, **changes)
        _set_limits(new)
        try:
            yield new
        finally:
            _set_limits(old)


def _set_limits(lim: Limits) -> None:
    g = globals()
    for f in dataclasses.fields(Limits):
        if f.name == "kernel_min":
            _kernels.KERNEL_MIN = lim.kernel_min
        else:
            g[f.name.upper()] = getattr(lim, f.name)
