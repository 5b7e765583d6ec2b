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

Backward (FlashAttention-2): recompute ``P = exp(S − lse)`` block by block from the saved log-sum-exp, with
``D_i = rowsum(dO ∘ O)``: ``dV += Pᵀ·dO``, ``dP = dO·Vᵀ``, ``dS = P ∘ (dP − D_i)``,
``dK += dSᵀ·Q·scale``, ``dQ += dS·K·scale``. Key blocks are the parallel unit (their ``dK``, ``dV`` belong to
one worker); ``dQ`` is summed from per-task partials.

Parallelism: tasks (batch × heads × query blocks forward, key blocks backward) run on a thread pool of
:func:`get_num_threads` workers, each pinned to its own CPU; NumPy releases the GIL inside matmul and ufunc
loops. While workers run, BLAS is limited to one thread each (``threadpoolctl``, from the ``fast`` extra;
without it BLAS keeps its own setting) so the cores are not oversubscribed. Tasks too small to pay for the
GIL hand-offs (SERIAL_BELOW_FLOPS) run on the calling thread.

Dropout draws its keep-mask per task from ``SeedSequence([seed, head, block start])`` with ``seed`` taken
from the caller's ``rng``: reproducible for a given ``rng``, shapes and block sizes, whatever the thread
count — but not the same random stream as the reference backend's.

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from .. import _checks
from .. import shapes
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
#: Causal diagonal squares are split in quadrants down to this many rows (see _Problem.key_blocks).
DIAGONAL_MIN = 128
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

# ---------------------------------------------------------------------------------------------- threads
# Worker pools, thread counts and BLAS's limit are process state: they live in qkv.backends.runtime (one
# object, RUNTIME, safe under concurrent callers); the thread-count functions are re-exported here.


# ---------------------------------------------------------------------------------------------- problem
_src = shapes.source_index


class _Problem:
    """Validated inputs as views per head, in the compute dtype; shared read-only by the workers."""

    def __init__(self, query, key, value, attn_mask, is_causal, scale, enable_gqa):
        self.cdt = np.dtype(np.float64 if query.dtype == np.float64 else np.float32)
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
        self._kv: dict = {}
        self._kv_lock = threading.Lock()
        self._kv_locks: dict = {}

    # leading index of the key/value head serving query lead index ``idx``
    def kv_index(self, idx: tuple) -> tuple:
        return shapes.kv_index(idx, self.n_rep)

    def kv(self, idx: tuple):
        """``(K, V, k_norm_max, v_abs_max, K_T_ext)`` for the key/value head of ``idx``, once per head.

        K (S, E), V (S, Ev) contiguous in the compute dtype; K_T_ext = [Kᵀ; 1] (E+1, S), contiguous rows,
        its row of ones multiplying the −m_i column of the query block (the running max folded into the
        matmul).
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

    def q_rows(self, idx: tuple, i0: int, i1: int) -> np.ndarray:
        """Scaled query rows ``Q[i0:i1]·scale`` (Bq, E) in the compute dtype: the scale folded in once."""
        q = self.query[_src(idx, self.query.shape[:-2])][i0:i1]
        return np.multiply(q, self.cdt.type(self.scale), dtype=self.cdt)

    def mask2d(self, idx: tuple):
        """The mask of head ``idx`` as an (L, S) view (broadcast, never copied), or None."""
        m = self.mask
        if m is None:
            return None
        if m.ndim < 2:
            m = m.reshape((1,) * (2 - m.ndim) + m.shape)
        m = m[_src(idx, m.shape[:-2])]
        return np.broadcast_to(m, (self.L, self.S))

    def key_blocks(self, i0: int, i1: int, mask2d, block_k: int):
        """The blocks query rows i0..i1 need: ``(r0, r1, j0, j1, kind)``, rows i0+r0 … i0+r1 against keys
        j0 … j1, kind "full", "causal" or "mask".

        Blocks a mask removes entirely are left out; blocks it allows entirely are "full". Causal: the keys
        before i0 in full blocks, then the diagonal square split in quadrants (upper-left and lower-right
        triangles recursively, lower-left full, upper-right skipped) down to DIAGONAL_MIN rows, so that
        what is computed and thrown away is n·DIAGONAL_MIN/2 scores per block of n rows, not n²/2::

            rows ↓  keys →     ■ full   ◣ causal   · skipped
            ■ ■ ■ ◣ ·
            ■ ■ ■ ■ ◣
        """
        S = self.S
        out = []
        if self.is_causal:                 # top-left: row i sees keys j <= i
            full_end = min(i0, S)          # keys every row sees (i0 itself goes with the diagonal block,
            #                                so that every block's width is a multiple of the block sizes)
            for j0 in range(0, full_end, block_k):
                out.append((0, i1 - i0, j0, min(j0 + block_k, full_end), "full"))
            self._diagonal(out, i0, 0, i1 - i0, block_k)
            return out
        for j0 in range(0, S, block_k):
            j1 = min(j0 + block_k, S)
            kind = _block_kind(mask2d, self.float_mask, i0, i1, j0, j1)
            if kind is not None:
                out.append((0, i1 - i0, j0, j1, kind))
        return out

    def _diagonal(self, out, i0, r0, r1, block_k):
        """Blocks of the causal square rows i0+r0 … i0+r1 × keys i0+r0 … i0+r1 (clipped at S)."""
        a, b = i0 + r0, min(i0 + r1, self.S)               # its keys
        if a >= b:
            return
        n = r1 - r0
        if n <= DIAGONAL_MIN:
            for j0 in range(a, b, block_k):
                out.append((r0, r1, j0, min(j0 + block_k, b), "causal"))
            return
        h = r0 + n // 2
        self._diagonal(out, i0, r0, h, block_k)            # upper-left triangle
        mid = min(i0 + h, self.S)
        for j0 in range(a, mid, block_k):                   # lower-left square: every key is before the rows
            out.append((h, r1, j0, min(j0 + block_k, mid), "full"))
        self._diagonal(out, i0, h, r1, block_k)            # lower-right triangle


_causal_cache: dict = {}


def _block_kind(mask2d, float_mask: bool, i0: int, i1: int, j0: int, j1: int):
    """How a (non-causal) block [i0:i1, j0:j1] is masked: "full" (nothing masked), "mask" (apply the
    mask's slice), or None (every entry masked: skip the block)."""
    if mask2d is None:
        return "full"
    if float_mask:
        return "mask"
    blk = mask2d[i0:i1, j0:j1]
    return "full" if blk.all() else ("mask" if blk.any() else None)


def _causal_additive(d: int, rows: int, cols: int, dtype) -> np.ndarray:
    """(rows, cols): −inf where key j0 + c is after query i0 + r (``c − r > d = i0 − j0``), 0 elsewhere.

    Added to a scores block (one vectorized ufunc pass). The same few patterns recur for every query block
    (mostly ``d = 0``: the diagonal block), so they are built once and kept. C order, as the scores: adding a
    Fortran-ordered pattern to a C-ordered block is ten times slower.
    """
    key = (d, rows, cols, np.dtype(dtype).char)
    got = _causal_cache.get(key)
    if got is None:
        blocked = np.arange(cols)[None, :] - np.arange(rows)[:, None] > d                # (rows, cols)
        got = np.ascontiguousarray(np.where(blocked, -np.inf, 0.0), dtype=dtype)
        if len(_causal_cache) > 64:
            _causal_cache.clear()
        _causal_cache[key] = got
    return got


def _apply_block_mask(s, kind, mask2d, i0, i1, j0, j1):
    """Mask the scores block ``s`` (Bq, bk) in place: disallowed → −inf, or add the float mask."""
    if kind == "full":
        return
    if kind == "causal":
        np.add(s, _causal_additive(i0 - j0, i1 - i0, j1 - j0, s.dtype), out=s)
        return
    blk = mask2d[i0:i1, j0:j1]
    if blk.dtype == np.bool_:
        np.copyto(s, -np.inf, where=~blk)
    else:
        np.add(s, blk, out=s, casting="unsafe")


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
def _forward_task(P: _Problem, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed):
    """One (head, query block): the online softmax over the key blocks; writes out/lse/weights rows."""
    with np.errstate(over="ignore", invalid="ignore"):      # overflow is detected and the block redone
        _forward_rows(P, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed)


def _forward_rows(P: _Problem, idx, i0, i1, block_k, out, lse, weights, dropout_p, seed):
    K, V, k_norm, v_max, K_T = P.kv(idx)                     # (S, E), (S, Ev), (E+1, S)
    E, Ev = P.E, P.Ev
    mask2d = P.mask2d(idx)
    Bq = i1 - i0
    qs = np.empty((Bq, E + 1), P.cdt)                        # [Q·scale, −m_i]: scale folded in once
    qs[:, :E] = P.q_rows(idx, i0, i1)
    qs[:, E] = 0.0
    blocks = P.key_blocks(i0, i1, mask2d, block_k)
    q_norm = float(np.sqrt(np.einsum("le,le->l", qs[:, :E], qs[:, :E]).max()))
    # How large a block's Σ exp(s − m_i) may grow before acc could overflow (float32 and float64 alike).
    log_room = _LOG_HEADROOM - math.log(P.S) - math.log1p(v_max)
    # Shift-free: no score can leave ±SHIFT_FREE_BOUND, so m_i = 0 for good.
    shift_free = (not P.float_mask and q_norm * k_norm <= SHIFT_FREE_BOUND
                  and SHIFT_FREE_BOUND < log_room)
    # Otherwise lazy rescaling: m_i (folded into the matmul as qs[:, E] = −m_i) is a max some block
    # attained; a block is exponentiated against it as is, and only when its row sums grow past
    # exp(LAZY_BOUND) (or a row has seen nothing yet) is it redone with a max pass and a rescale.
    lazy = not shift_free and dropout_p == 0 and log_room > LAZY_BOUND + 1
    row_limit = math.exp(LAZY_BOUND)
    s_buf = _scratch(Bq, min(block_k, P.S), P.cdt)          # (Bq, bk) scores, then probabilities
    ones = np.ones(min(block_k, P.S), P.cdt)
    tmp = np.empty((Bq, Ev), P.cdt)
    l_blk = np.empty(Bq, P.cdt)
    acc = np.zeros((Bq, Ev), P.cdt)                          # Σ p·v per row
    l_i = np.zeros(Bq, P.cdt)                                # Σ p per row (before dropout)
    m_i = np.zeros(Bq, P.cdt)                                # running max (the shift actually subtracted)
    seen = np.full(Bq, shift_free)                           # m_i is a max some block attained
    all_seen = shift_free
    gen = _dropout_rng(seed, P.lead, idx, i0) if dropout_p > 0 else None
    keep_scale = 0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)
    for r0, r1, j0, j1, kind in blocks:
        rs = slice(r0, r1)                                   # the block's rows (all, but on the diagonal)
        s = s_buf[rs, :j1 - j0]
        a0, a1 = i0 + r0, i0 + r1                            # absolute query rows, for the masks
        if shift_free:
            np.matmul(qs[rs, :E], K_T[:E, j0:j1], out=s)     # (Bq, E) x (E, bk) -> (Bq, bk)
            _apply_block_mask(s, kind, mask2d, a0, a1, j0, j1)
            np.exp(s, out=s)                                 # p = exp(s − 0)
        else:
            np.matmul(qs[rs], K_T[:, j0:j1], out=s)          # (Bq, E+1) x (E+1, bk) -> s − m_i
            _apply_block_mask(s, kind, mask2d, a0, a1, j0, j1)
            if lazy and all_seen:
                np.exp(s, out=s)                             # p = exp(s − m_i), m_i unchanged
                lb = l_blk[rs]
                np.matmul(s, ones[:j1 - j0], out=lb)         # (Bq, bk) x (bk,) -> (Bq,) row sums
                if np.all(lb <= row_limit):                  # (NaN/inf fail too)
                    t = tmp[rs]
                    np.matmul(s, V[j0:j1], out=t)            # (Bq, bk) x (bk, Ev) -> (Bq, Ev)
                    acc[rs] += t
                    l_i[rs] += lb
                    continue
                np.matmul(qs[rs], K_T[:, j0:j1], out=s)      # grew too much: redo with a max pass
                _apply_block_mask(s, kind, mask2d, a0, a1, j0, j1)
            # -- update m_i: raise it to this block's max; rescale what was accumulated under the old
            m_blk = np.maximum.reduce(s, axis=1)             # relative to the current m_i; −inf if all masked
            hit = np.isfinite(m_blk)
            seen_r = seen[rs]
            shift = np.where(seen_r, np.maximum(m_blk, 0.0), np.where(hit, m_blk, 0.0)).astype(P.cdt)
            np.subtract(s, shift[:, None], out=s)
            np.exp(s, out=s)                                 # p = exp(s − m_i)
            alpha = np.where(seen_r, np.exp(-shift), 0.0)    # exp(m_old − m_new); nothing yet: 0
            acc[rs] *= alpha[:, None]
            l_i[rs] *= alpha
            m_i[rs] += shift
            qs[rs, E] = -m_i[rs]
            seen[rs] |= hit
            all_seen = bool(seen.all())
        lb = l_blk[rs]
        np.matmul(s, ones[:j1 - j0], out=lb)                 # (Bq, bk) x (bk,) -> (Bq,) row sums
        l_i[rs] += lb                                        # the softmax denominator ignores dropout
        if gen is not None:
            keep = gen.random(s.shape, dtype=np.float32) >= dropout_p
            np.multiply(s, keep, out=s)
            s *= keep_scale
        t = tmp[rs]
        np.matmul(s, V[j0:j1], out=t)                        # (Bq, bk) x (bk, Ev) -> (Bq, Ev)
        acc[rs] += t
    nz = l_i > 0                                             # l_i = 0: a query that may attend to nothing
    inv = np.divide(1.0, l_i, out=np.zeros_like(l_i), where=nz)
    out[idx][i0:i1] = acc * inv[:, None]
    log_l = np.log(l_i, out=np.full_like(l_i, -np.inf), where=nz)
    row_lse = np.where(nz, m_i + log_l, -np.inf)
    if lse is not None:
        lse[idx][i0:i1] = row_lse
    if weights is not None:                                  # second pass: p = exp(s − lse), stored
        gen = _dropout_rng(seed, P.lead, idx, i0) if dropout_p > 0 else None
        sub = np.where(nz, row_lse, np.inf)[:, None]         # fully masked rows: exp(−inf) = 0
        w_rows = weights[idx]
        for r0, r1, j0, j1, kind in blocks:
            s = s_buf[r0:r1, :j1 - j0]
            np.matmul(qs[r0:r1, :E], K_T[:E, j0:j1], out=s)  # (Bq, E) x (E, bk) -> (Bq, bk)
            _apply_block_mask(s, kind, mask2d, i0 + r0, i0 + r1, j0, j1)
            np.subtract(s, sub[r0:r1], out=s)
            np.exp(s, out=s)
            if gen is not None:
                keep = gen.random(s.shape, dtype=np.float32) >= dropout_p
                np.multiply(s, keep, out=s)
                s *= keep_scale
            w_rows[i0 + r0:i0 + r1, j0:j1] = s


def forward(query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale, enable_gqa=False,
            rng=None, return_weights=False, return_lse=False, threads=None, block_q=None, block_k=None):
    """The tiled forward on validated arrays; returns ``(output, weights|None, lse|None)``.

    ``output`` (..., Hq, L, Ev) in the input dtype; ``lse`` (..., Hq, L) in the compute dtype (float32 for
    float16/32 inputs), −inf on fully masked rows; ``weights`` (..., Hq, L, S) only when asked for.
    ``block_q``/``block_k`` override the block sizes (tests use small ones to hit block boundaries).
    """
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else BLOCK_Q
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else BLOCK_K
    bq = min(bq, P.L)
    # Enough tasks to keep every worker busy: shrink the query block when there are few heads.
    n_heads = math.prod(P.lead)
    while block_q is None and bq > 64 and n_heads * math.ceil(P.L / bq) < 2 * threads:
        bq //= 2
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
             for i0 in starts for idx in np.ndindex(*P.lead)]
    if 2 * bq * P.S * (P.E + P.Ev) < SERIAL_BELOW_FLOPS:
        threads = 1
    RUNTIME.run(tasks, _forward_task, threads)
    dt = query.dtype
    return (out.astype(dt, copy=False), None if weights is None else weights.astype(dt, copy=False), lse)


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
    features = frozenset({"mask", "causal", "dropout", "weights", "lse", "backward", "threads"})

    def prefers(self, query, key, value, *, enable_gqa=False) -> bool:
        per_head = query.shape[-2] * key.shape[-2]
        return (shapes.n_scores(query.shape, key.shape, enable_gqa) >= AUTO_TILED_MIN_SCORES
                and per_head >= AUTO_TILED_MIN_HEAD_SCORES and key.shape[-2] >= AUTO_MIN_KEYS)

    def forward(self, query, key, value, **kw):
        return forward(query, key, value, **_plain(kw))

    def backward(self, grad_out, query, key, value, **kw):
        return backward(grad_out, query, key, value, **_plain(kw))


def _plain(kw: dict) -> dict:
    """Drop the flex arguments that are not set (None)."""
    return {k: v for k, v in kw.items() if not (k in ("score_mod", "block_mask", "sink_logits") and v is None)}


TILED = TiledBackend()


def tiled_attention(query, key, value, **kw):
    """The older function form of the tiled backend: ``(output, weights)`` or ``(…, lse)``."""
    return TILED(query, key, value, **kw)


# ---------------------------------------------------------------------------------------------- backward
def _backward_task(P: _Problem, kv_idx, q_heads, key_starts, block_q, block_k, dq_part, dk, dv, prep):
    """dK, dV of the key blocks ``key_starts`` of one key/value head; dQ into this task's partial."""
    K, V, _, _, _ = P.kv(q_heads[0])
    L, E, Ev = P.L, P.E, P.Ev
    bq, bk = min(block_q, L), min(block_k, P.S)
    s_buf = _scratch(bq, bk, P.cdt)                          # (Bq, bk) scores, then P
    dp_buf = _scratch(bq, bk, P.cdt, "dp")                   # (Bq, bk) dP, then dS
    dv_t, dk_t, dq_t = np.empty((bk, Ev), P.cdt), np.empty((bk, E), P.cdt), np.empty((bq, E), P.cdt)
    for j0 in key_starts:
        j1 = min(j0 + block_k, P.S)
        n = j1 - j0
        dk_j = np.zeros((n, E), P.cdt)
        dv_j = np.zeros((n, Ev), P.cdt)
        Kj, Vj = K[j0:j1], V[j0:j1]
        for r, idx in enumerate(q_heads):
            qs, do, lse_neg, D = prep[idx]                   # (L, E), (L, Ev), (L,), (L,)
            mask2d = P.mask2d(idx)
            i_start = j0 if P.is_causal else 0              # causal: rows i < j0 see none of these keys
            for i0 in range(i_start - i_start % block_q, L, block_q):
                i1 = min(i0 + block_q, L)
                if P.is_causal:
                    kind = "full" if i0 >= j1 - 1 else "causal"
                else:
                    kind = _block_kind(mask2d, P.float_mask, i0, i1, j0, j1)
                    if kind is None:
                        continue
                m = i1 - i0
                s = s_buf[:m, :n]
                np.matmul(qs[i0:i1], Kj.T, out=s)            # (Bq, E) x (E, bk) -> (Bq, bk)
                _apply_block_mask(s, kind, mask2d, i0, i1, j0, j1)
                np.add(s, lse_neg[i0:i1, None], out=s)
                p = np.exp(s, out=s)                          # P = exp(S − lse), recomputed
                np.matmul(p.T, do[i0:i1], out=dv_t[:n])       # (bk, Bq) x (Bq, Ev) -> (bk, Ev)
                dv_j += dv_t[:n]
                dp = dp_buf[:m, :n]
                np.matmul(do[i0:i1], Vj.T, out=dp)           # (Bq, Ev) x (Ev, bk) -> (Bq, bk)
                np.subtract(dp, D[i0:i1, None], out=dp)
                np.multiply(dp, p, out=dp)                    # dS = P ∘ (dP − D)
                np.matmul(dp.T, qs[i0:i1], out=dk_t[:n])     # (bk, Bq) x (Bq, E) -> (bk, E)  (scale in qs)
                dk_j += dk_t[:n]
                np.matmul(dp, Kj, out=dq_t[:m])              # (Bq, bk) x (bk, E) -> (Bq, E)
                dq_part[r][i0:i1] += dq_t[:m]
        dk[kv_idx][j0:j1] = dk_j
        dv[kv_idx][j0:j1] = dv_j


_sum_to_shape = shapes.sum_to_shape


def backward(grad_out, query, key, value, *, attn_mask=None, is_causal=False, scale, enable_gqa=False,
             threads=None, block_q=None, block_k=None, out=None, lse=None):
    """Gradients ``(dQ, dK, dV)`` of ``sum(grad_out ∘ attention(query, key, value))``, tiled.

    ``out``/``lse`` from a previous :func:`forward` (with ``return_lse=True``) skip its recomputation.
    """
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    bq = _checks.positive_int(block_q, "block_q") if block_q is not None else BLOCK_Q_BACKWARD
    bk = _checks.positive_int(block_k, "block_k") if block_k is not None else BLOCK_K_BACKWARD
    if out is None or lse is None:
        out, _, lse = forward(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa, return_lse=True, threads=threads)
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
    for idx in np.ndindex(*lead):                           # per query head: Q·scale, dO, −lse, D
        do = np.asarray(grad_out[idx], dtype=P.cdt)
        o = np.asarray(out[idx], dtype=P.cdt)
        D = np.einsum("le,le->l", do, o)                      # D_i = rowsum(dO ∘ O)
        lse_neg = np.where(np.isfinite(lse[idx]), -lse[idx], -np.inf).astype(P.cdt)   # dead rows: P = 0
        prep[idx] = (P.q_rows(idx, 0, P.L), np.ascontiguousarray(do), lse_neg, D)
    tasks, partials = [], []
    for kv_idx in np.ndindex(*kv_lead):
        heads = shapes.query_heads(kv_idx, P.n_rep)
        for c in range(n_chunks):
            part = np.zeros((len(heads), P.L, P.E), P.cdt)
            partials.append((heads, part))
            tasks.append((P, kv_idx, heads, key_starts[c::n_chunks], bq, bk, part, dk, dv, prep))
    if 2 * min(bk, P.S) * P.L * (2 * P.E + 3 * P.Ev) * P.n_rep < SERIAL_BELOW_FLOPS:
        threads = 1
    RUNTIME.run(tasks, _backward_task, threads)
    for heads, part in partials:
        for r, idx in enumerate(heads):
            dq[idx] += part[r]
    dq *= P.cdt.type(P.scale)                                 # dQ = dS·K·scale
    dt = query.dtype
    dq = _sum_to_shape(dq, query.shape).astype(dt, copy=False)
    dk = _sum_to_shape(dk, key.shape).astype(dt, copy=False)
    dv = _sum_to_shape(dv, value.shape).astype(dt, copy=False)
    return dq, dk, dv
