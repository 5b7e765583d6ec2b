"""Scoring: a block's scores as the softmax needs them — ``score_mod(Q·Kᵀ·scale)``, masked, minus a row shift.

:class:`_Scorer` turns a block of keys into scores in as few passes as the mod and the masks allow. What it may
assume of a mod it reads from the mod's traits (:class:`qkv.mods.ScoreTraits`, :class:`qkv.mods.MaskTraits`),
never from its name: :class:`_ModPlan` says how a score mod is applied.

* *Score mods* on the scaled scores of each block, ``b``/``h`` the flattened batch and head indices. **ALiBi**
  (a bias with slopes) ``m·(j − i) = m·(j − ρ) + m·(ρ − i)``: the row term rides in the matmul (the extra
  query column times Kᵀ's row of ones), the column term is one broadcast add, and a block that straddles the
  diagonal adds a cached bias pattern. **Softcap** (a cap) folds ``1/cap`` into the query scale, so a block is
  matmul → tanh → ×cap → exp, with a fitted polynomial instead of tanh in float32 when the block's bound allows
  (:func:`_tanh_poly`). Any other mod — one without traits — is called on the block
  (:func:`qkv.mods.call_score_mod`), on every path, before a fused kernel's plan too.
* *Masks*: the causal triangle and a mask mod's partial cells that depend on ``i − j`` alone are 0/−inf
  patterns cached per offset (the same few recur every block); other partial cells call the mask mod on the
  cell run; ``attn_mask`` by its slice.
* With the fused kernels (:mod:`qkv.kernels`, ``fuse=True``) the scorer leaves what a kernel does in one pass —
  softcap, the causal diagonal's mask, the shift ``−m_i`` — undone and returns the plan for it.

Patterns and per-thread scratch buffers live here too (:func:`_cached`, :func:`_scratch`).

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width.
"""
from __future__ import annotations

import math

import numpy as np

from qkv.compute import paths as _paths
from qkv.compute.gemm import matmul as _mm  # matmuls by the runtime's provider (qkv.gemm)
from qkv.compute.kernels import NO_MASK as _NO_MASK
from qkv.engine.backends.runtime import RUNTIME
from qkv.core.mods import UNKNOWN as _UNKNOWN_MASK, ScoreTraits as _ScoreTraits
from qkv.core.mods import call_mask_mod, call_score_mod, score_mod_grad, score_mod_vjp

# Every way of applying a mod or a mask, counted where it runs (qkv.paths).
_R = _paths.register
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


# ---------------------------------------------------------------------------------------------- mods' traits
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


# ---------------------------------------------------------------------------------------------- patterns
# Patterns that recur block after block, built once: the causal triangle per offset, a translation-invariant
# mask mod's partial cells per offset, ALiBi's bias per (slope, offset), in the runtime's bounded cache.
def _cached(key, build):
    """``build()`` (a tuple holding arrays), kept under ``key`` in the runtime's pattern cache."""
    return RUNTIME.patterns.get(key, build)


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
        q = np.arange(rows, dtype=np.int64)[:, None] + d
        kv = np.arange(cols, dtype=np.int64)[None, :]
        m = np.broadcast_to(call_mask_mod(mod, np.zeros((), np.int64), np.zeros((), np.int64), q, kv),
                            (rows, cols))
        return mod, np.ascontiguousarray(np.where(m, 0.0, -np.inf), dtype=dtype)
    got = _cached(("mod", id(mod), d, rows, cols, np.dtype(dtype).char), build)
    if got[0] is not mod:                                    # an id reused by a new mod: rebuild
        RUNTIME.patterns.drop(("mod", id(mod), d, rows, cols, np.dtype(dtype).char))
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


#: A (rows, cols) block of the calling thread's scratch memory, reused from task to task and call to call (the
#: runtime's: :meth:`qkv.backends.runtime.Runtime.scratch`).
_scratch = RUNTIME.scratch


# ---------------------------------------------------------------------------------------------- the scorer
class _Scorer:
    """The scores of one head's blocks as the softmax needs them: ``score_mod(Q·Kᵀ·scale)``, masked, minus a
    per-row shift — as few passes over the block as the mod allows.

    ``qs`` holds the scaled query rows (from absolute row ``row0``), with an extra column when ``row_col``
    (the forward): that column times K_T's row of ones puts a per-row term into the matmul for free (−m_i,
    ALiBi's row term). Without it (the backward, whose query rows other workers share) a row term is one
    broadcast add.
    """

    def __init__(self, P, idx: tuple, qs: np.ndarray, row0: int, K_T: np.ndarray, mask2d, row_col: bool):
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
        broadcasts to it, or None when it is 1; for a generic mod with a ``vjp``, the function ``dS' -> dS``);
        ``raw`` a second buffer the generic mod's grad needs.
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
                # the causal −inf rides in the pattern only without a cap: softcap after it would make −inf −cap
                causal = kind == "causal" and self.cap is None
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
        derivative there too (``raw`` keeps the scores it is taken at). Returns the derivative, or for a mod with
        a ``vjp`` the function ``dS' -> dS`` on this block, or None."""
        P = self.P
        q_idx = np.arange(a0, a1, dtype=np.int64)[:, None]
        kv_idx = np.arange(j0, j1, dtype=np.int64)[None, :]
        if grad is not None:
            np.copyto(raw, s)
        got = call_score_mod(P.mod.mod, s, self.sb, self.sh, q_idx, kv_idx)
        if got is not s:
            np.copyto(s, got)
        if grad is not None and getattr(P.mod.mod, "has_vjp", False):  # dS = vjp(dS'), on the raw scores
            mod, b, h = P.mod.mod, self.sb, self.sh
            return lambda ds: score_mod_vjp(mod, raw, b, h, q_idx, kv_idx, ds)
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
                    _paths.hit(M_MASK_MOD)
                    allowed = call_mask_mod(mod, self.mb, self.mh, np.arange(o0, o1, dtype=np.int64)[:, None],
                                            np.arange(c0, c1, dtype=np.int64)[None, :])
                    np.copyto(sub, -np.inf, where=~np.broadcast_to(allowed, sub.shape))
            if v & 2:
                np.add(sub, _causal_additive(o0 - c0, o1 - o0, c1 - c0, s.dtype), out=sub)
            if v & 4:
                _apply_block_mask(sub, "mask", self.mask2d, o0, o1, c0, c1)


# ---------------------------------------------------------------------------------------------- softcap
#: Softcap's polynomial runs over a block this many scores at a time, so that its passes (the chunk, t and p:
#: 768 KB) stay in L2: three quarters of the time of one pass over the whole block.
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
    return RUNTIME.memo.get(("tanh_poly", Y), lambda: _fit_tanh(Y))      # kept per bound (the runtime's memo)


def _fit_tanh(Y: float):
    """:func:`_tanh_poly`'s coefficients for the bound ``Y``, fitted (None where 7 terms do not reach 2e-8)."""
    from numpy.polynomial import Polynomial
    for n in range(2, 8):
        x = np.cos(np.pi * (np.arange(n) + 0.5) / n)              # Chebyshev nodes on [0, Y²]
        tn = (x + 1) / 2 * Y * Y
        yn = np.sqrt(tn)
        fit = Polynomial.fit(tn, np.tanh(yn) / yn, n - 1, domain=[0, Y * Y]).convert()
        t = np.linspace(0, Y * Y, 4001)[1:]
        if np.abs(fit(t) * np.sqrt(t) / np.tanh(np.sqrt(t)) - 1).max() < 2e-8:
            return [float(a) for a in fit.coef]
    return None
