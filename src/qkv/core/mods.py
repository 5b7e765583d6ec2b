"""Mask mods and score mods: the attention variants of today, as FlexAttention writes them.

A **mask mod** says which keys a query may see: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend,
as every mask in qkv). A **score mod** says what a scaled score becomes: ``score_mod(score, b, h, q_idx,
kv_idx) -> score``. qkv calls both with NumPy arrays that broadcast over a block — ``score`` (…, Lb, Sb),
``q_idx`` (Lb, 1), ``kv_idx`` (1, Sb), ``b`` and ``h`` shaped to broadcast (e.g. ``h`` (H, 1, 1)) — so a mod
written with operators and ufuncs (``np.where``, ``np.tanh``, comparisons) works unchanged::

    def my_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

Built in: mask mods :func:`causal`, :func:`sliding_window`, :func:`prefix_lm`, :func:`document`,
:func:`document_from_lengths`, :func:`sinks`, combined with :func:`and_masks` / :func:`or_masks`
(StreamingLLM is ``or_masks(sinks(4), sliding_window(w))``); score mods :func:`alibi` (with
:func:`alibi_slopes`) and :func:`softcap`, chained with :func:`compose`.

Every built-in mask mod also knows, from a block's index ranges alone, whether the block is surely empty or
surely full (:meth:`MaskMod.block_kinds`), so :func:`qkv.create_block_mask` never evaluates it element by
element and the tiled engine skips empty blocks and never masks full ones. Every built-in score mod carries
its derivative (:meth:`ScoreMod.grad`) for :func:`qkv.flex_attention_backward`; a custom score mod needs one
(``ScoreMod(fn, grad=...)``), or the backward refuses it. A bias (ALiBi) is a score mod, not a mask.

**Traits.** A built-in mod also declares what a fused engine may assume of it without calling it:
:class:`MaskTraits` (``mod.traits``: a function of ``i − j`` alone, allows the diagonal, causal) and
:class:`ScoreTraits` (a bias ``m_h·(j − i)`` with ALiBi's slopes, a cap for softcap, the chain of
:func:`compose`). The tiled engine reads these, never a mod's name or module: ALiBi's bias rides in the
product, softcap's ``1/cap`` in the query scale, an ``i − j`` mask's partial blocks are cached patterns. A mod
without traits — any callable, or ``ScoreMod(fn, grad=...)`` / ``ScoreMod(fn, vjp=...)`` — is called on every
block (the generic path).
:func:`and_masks` / :func:`or_masks` derive their traits from their children's (a child without traits
counts as knowing nothing).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from qkv import _checks
from qkv.core import stages
from qkv.core.stages import Names

__all__ = ["MaskMod", "MaskTraits", "ScoreMod", "ScoreTraits", "causal", "sliding_window", "prefix_lm", "document",
           "document_from_lengths", "sinks", "and_masks", "or_masks", "alibi", "alibi_slopes", "softcap", "compose"]


# ============================================================================================== mask mods
@dataclasses.dataclass(frozen=True)
class MaskTraits:
    """What an engine may assume of a mask mod without calling it (each False: not known).

    Attributes:
        invariant: it depends on ``i − j`` alone (``mask(i + t, j + t) == mask(i, j)``), so its partial blocks
            repeat per offset and may be cached as patterns.
        diagonal: it allows every ``(i, i)``.
        causal: it allows no ``j > i``.
    """
    invariant: bool = False
    diagonal: bool = False
    causal: bool = False

    def combine(self, other: "MaskTraits", both: bool) -> "MaskTraits":
        """The traits of two mods joined: ``both`` (and_masks) or either (or_masks)."""
        inv = self.invariant and other.invariant
        if both:                                        # allowed where both allow it
            return MaskTraits(inv, self.diagonal and other.diagonal, self.causal or other.causal)
        return MaskTraits(inv, self.diagonal or other.diagonal, self.causal and other.causal)


#: The traits of a mod that declares none: nothing known.
UNKNOWN = MaskTraits()


class MaskMod:
    """A mask mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool array`` (True = may attend).

    Args:
        fn: the function.
        name: what it is ("causal", "sliding_window", …; the explainer says why a key is hidden by it).
        params: its parameters by name (``{"window": 4}``), for the explainer and ``repr``.
        block_kinds: ``(q0, q1, k0, k1) -> (any, all)``, or None: given block bounds (``q0``/``q1`` (nQ, 1)
            first and one-past-last query of each block, ``k0``/``k1`` (1, nK) the same for keys), arrays
            broadcastable to (…, nQ, nK): ``any`` False means no entry of the block is allowed, ``all`` True
            means every entry is. Conservative is fine (``any`` True and ``all`` False for an unsure block:
            it is evaluated element by element).
        children: the mods it combines (and_masks / or_masks).
        validate: ``(B, H, L, S) -> None``, or None: raises ValueError naming the parameter when the mod cannot
            serve these sizes (``doc_ids`` of the wrong length …); B/H may be None (broadcast).
        traits: :class:`MaskTraits` the mod promises (the built-ins declare theirs), or None: nothing known
            (the engine calls the mod on each partial block).
    """

    def __init__(self, fn, *, name: str | None = None, params: dict | None = None, block_kinds=None,
                 children: tuple = (), validate=None, traits: MaskTraits | None = None):
        if not callable(fn):
            raise TypeError(f"mask_mod: expected a callable (b, h, q_idx, kv_idx) -> bool, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "mask_mod")
        self.params = dict(params or {})
        self._block_kinds = block_kinds
        self.children = tuple(children)
        self._validate = validate
        if traits is not None and not isinstance(traits, MaskTraits):
            raise TypeError(f"traits: expected a qkv.mods.MaskTraits or None, got {type(traits).__name__}")
        self.traits = traits

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def block_kinds(self, q0, q1, k0, k1):
        """``(any, all)`` for blocks bounded by q0…q1 × k0…k1 (see the class doc), or None if unknown."""
        return None if self._block_kinds is None else self._block_kinds(q0, q1, k0, k1)

    def validate(self, B, H, L: int, S: int) -> None:
        """ValueError (naming the parameter) when this mod, or one it combines, cannot serve B × H × L × S."""
        if self._validate is not None:
            self._validate(B, H, L, S)
        for c in self.children:
            c.validate(B, H, L, S)

    def __repr__(self) -> str:
        if self.children:
            return f"{self.name}({', '.join(map(repr, self.children))})"
        inner = ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"{self.name}({inner})"


def _short(v) -> str:
    if isinstance(v, np.ndarray):
        return f"array{v.shape}" if v.size > 8 else repr(v.tolist())
    return repr(v)


def as_mask_mod(fn, name: str = "mask_mod") -> MaskMod:
    """A :class:`MaskMod` for a plain callable (unknown block structure: evaluated element by element)."""
    if isinstance(fn, MaskMod):
        return fn
    if not callable(fn):
        raise TypeError(f"{name}: expected a callable (b, h, q_idx, kv_idx) -> bool, got {type(fn).__name__}")
    return MaskMod(fn)


def call_mask_mod(mask_mod, b, h, q_idx, kv_idx, *, name: str = "mask_mod") -> np.ndarray:
    """Evaluate a mask mod on index arrays and check what it returns: a bool array that broadcasts with
    ``q_idx`` (Lb, 1) × ``kv_idx`` (1, Sb) and the leading shape of ``b``/``h``. Returns the bool array,
    broadcastable to (…, Lb, Sb)."""
    out = mask_mod(b, h, q_idx, kv_idx)
    if isinstance(out, (bool, np.bool_)):
        out = np.asarray(out)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: expected it to return a numpy bool array, got {type(out).__name__}")
    if out.dtype != np.bool_:
        raise TypeError(f"{name}: expected it to return dtype bool (True = may attend), got {out.dtype}")
    target = np.broadcast_shapes(np.shape(b), np.shape(h), q_idx.shape[:-1] + (1,), (1,) + kv_idx.shape[-1:])
    try:
        got = np.broadcast_shapes(out.shape, target)
    except ValueError:
        got = None
    if got is None or len(out.shape) > len(target) or got != target and got[-2:] != target[-2:]:
        raise ValueError(f"{name}: expected a result broadcastable to {target} (…, {q_idx.shape[0]} queries, "
                         f"{kv_idx.shape[-1]} keys), got shape {out.shape}")
    return out


def _window_kinds(lo: int, hi: int):
    """Block kinds of ``lo ≤ i − j ≤ hi`` (±inf allowed), from the range of i − j over a block."""
    def kinds(q0, q1, k0, k1):
        d_min = q0 - (k1 - 1)                                        # (nQ, nK) smallest i − j in the block
        d_max = (q1 - 1) - k0                                        # largest
        return (d_max >= lo) & (d_min <= hi), (d_min >= lo) & (d_max <= hi)
    return kinds


def causal() -> MaskMod:
    """Query i may attend to keys j ≤ i (torch's ``is_causal``, top-left). Traits: a function of ``i − j``,
    allows the diagonal, causal."""
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return MaskMod(causal_mask, name="causal", block_kinds=_window_kinds(0, math.inf),
                   traits=MaskTraits(invariant=True, diagonal=True, causal=True))


def sliding_window(window: int) -> MaskMod:
    """Causal sliding window: query i sees keys i − window + 1 … i (``window`` keys, itself included)::

        window = 3      k0 k1 k2 k3 k4
                   q0    1  0  0  0  0
                   q1    1  1  0  0  0
                   q2    1  1  1  0  0
                   q3    0  1  1  1  0
                   q4    0  0  1  1  1

    Traits: a function of ``i − j``, allows the diagonal, causal.
    """
    window = _checks.positive_int(window, "window")

    def sliding_window_mask(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & (d < window)
    return MaskMod(sliding_window_mask, name="sliding_window", params={"window": window},
                   block_kinds=_window_kinds(0, window - 1),
                   traits=MaskTraits(invariant=True, diagonal=True, causal=True))


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix LM: every query sees the first ``prefix_len`` keys (the prefix, bidirectional), and the
    rest causally (key j ≤ i). Traits: allows the diagonal."""
    prefix_len = _checks.positive_int(prefix_len, "prefix_len", minimum=0)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    causal_kinds = _window_kinds(0, math.inf)

    def kinds(q0, q1, k0, k1):
        c_any, c_all = causal_kinds(q0, q1, k0, k1)
        p_any, p_all = k0 < prefix_len, k1 - 1 < prefix_len
        return c_any | p_any, c_all | p_all
    return MaskMod(prefix_lm_mask, name="prefix_lm", params={"prefix_len": prefix_len}, block_kinds=kinds,
                   traits=MaskTraits(diagonal=True))


def sinks(n: int) -> MaskMod:
    """The first ``n`` keys are always visible (StreamingLLM's attention sinks); combine with a window:
    ``or_masks(sinks(4), sliding_window(w))``. Traits: none of the three (it depends on ``j`` alone; it allows
    the diagonal only for the first ``n`` queries)."""
    n = _checks.positive_int(n, "n", minimum=0)

    def sinks_mask(b, h, q_idx, kv_idx):
        return np.broadcast_to(kv_idx < n, np.broadcast_shapes(q_idx.shape, kv_idx.shape))

    def kinds(q0, q1, k0, k1):
        grid = np.broadcast_shapes(q0.shape, k0.shape)                       # (nQ, nK)
        return np.broadcast_to(k0 < n, grid), np.broadcast_to(k1 - 1 < n, grid)
    return MaskMod(sinks_mask, name="sinks", params={"n": n}, block_kinds=kinds, traits=MaskTraits())


def document(doc_ids) -> MaskMod:
    """Packed sequences: query i may attend to key j only when both belong to the same document.

    ``doc_ids``: (S,) ints, the document of each position (the same for queries and keys: self-attention
    over the packed sequence), or (B, S) for a different packing per batch row. Combine with
    :func:`causal` for causal packing: ``and_masks(causal(), document(ids))``. Traits: allows the diagonal.
    """
    ids = _int_array(doc_ids, "doc_ids")
    if ids.ndim not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(f"doc_ids: expected shape (S,) or (B, S) with S ≥ 1, got {ids.shape}")
    if ids.ndim == 1:
        def document_mask(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]
    else:
        def document_mask(b, h, q_idx, kv_idx):
            bb = np.asarray(b)[..., None, None] if np.ndim(b) == 0 else np.asarray(b)
            return ids[bb, q_idx] == ids[bb, kv_idx]

    def kinds(q0, q1, k0, k1):
        qmin, qmax = _range_reduce(ids, q0[:, 0], q1[:, 0])                 # (…, nQ)
        kmin, kmax = _range_reduce(ids, k0[0], k1[0])                       # (…, nK)
        qmin, qmax = qmin[..., :, None], qmax[..., :, None]
        kmin, kmax = kmin[..., None, :], kmax[..., None, :]
        any_ = (qmin <= kmax) & (kmin <= qmax)
        all_ = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        if ids.ndim == 2:                                                   # (B, nQ, nK) -> (B, 1, nQ, nK)
            any_, all_ = any_[:, None], all_[:, None]
        return any_, all_

    def validate(B, H, L, S):
        if ids.shape[-1] != max(L, S):
            raise ValueError(f"doc_ids: expected {max(L, S)} document ids (one per position: max(Q_LEN={L}, "
                             f"KV_LEN={S})), got {ids.shape[-1]}")
        if ids.ndim == 2 and ids.shape[0] != (1 if B is None else B):
            need = "B=None (broadcast) takes one row" if B is None else f"B={B} takes one row per batch row"
            raise ValueError(f"doc_ids: expected shape ({1 if B is None else B}, {ids.shape[-1]}) ({need}; "
                             f"per-batch ids need create_block_mask(mask_mod, B={ids.shape[0]}, …)), "
                             f"got {ids.shape}")
    return MaskMod(document_mask, name="document", params={"doc_ids": ids}, block_kinds=kinds, validate=validate,
                   traits=MaskTraits(diagonal=True))


def document_from_lengths(lengths) -> MaskMod:
    """:func:`document` for documents packed one after another: ``lengths`` [3, 5, 2] → ids 0 0 0 1 1 1 1 1 2 2
    (so their sum is the sequence length)."""
    lengths = _int_array(lengths, "lengths")
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError(f"lengths: expected a non-empty 1-D sequence of document lengths, got shape {lengths.shape}")
    if np.any(lengths <= 0):
        raise ValueError(f"lengths: expected positive lengths, got {lengths.tolist()}")
    return document(np.repeat(np.arange(lengths.size), lengths))


def _int_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.size == 0 and arr.dtype == np.float64 and not isinstance(x, np.ndarray):
        arr = arr.astype(np.int64)                           # [] is an empty sequence of ints: a shape error
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _range_reduce(ids: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """Min and max of ``ids[..., s:e]`` for each (s, e) range (clipped to the array; empty → +inf/−inf)."""
    n = ids.shape[-1]
    starts = np.clip(starts, 0, n)
    ends = np.clip(ends, 0, n)
    lo = np.full(ids.shape[:-1] + (len(starts),), np.iinfo(np.int64).max, np.int64)
    hi = np.full(ids.shape[:-1] + (len(starts),), np.iinfo(np.int64).min, np.int64)
    for i, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            lo[..., i] = ids[..., s:e].min(axis=-1)
            hi[..., i] = ids[..., s:e].max(axis=-1)
    return lo, hi


def and_masks(*mods) -> MaskMod:
    """Attention allowed where **every** mod allows it (block kinds: ``all`` exact, ``any`` conservative).
    Traits: a function of ``i − j`` if every mod is, allows the diagonal if every mod does, causal if any is."""
    return _combine(mods, "and_masks", np.logical_and)


def or_masks(*mods) -> MaskMod:
    """Attention allowed where **any** mod allows it (block kinds: ``any`` exact, ``all`` conservative).
    Traits: a function of ``i − j`` if every mod is, allows the diagonal if any mod does, causal if every is."""
    return _combine(mods, "or_masks", np.logical_or)


def _combine(mods, name: str, op) -> MaskMod:
    """One mask mod from several, joined elementwise by ``op``; their block kinds joined by the same ``op``, their
    traits likewise (a child without traits: :data:`UNKNOWN`)."""
    if not mods:
        raise ValueError(f"{name}: expected at least one mask mod, got none")
    ms = [as_mask_mod(m, f"{name}[{i}]") for i, m in enumerate(mods)]

    def combined(b, h, q_idx, kv_idx):
        out = ms[0](b, h, q_idx, kv_idx)
        for m in ms[1:]:
            out = op(out, m(b, h, q_idx, kv_idx))
        return out
    combined.__name__ = name.rstrip("s")

    def kinds(q0, q1, k0, k1):
        got = [m.block_kinds(q0, q1, k0, k1) for m in ms]
        if any(g is None for g in got):
            return None
        any_, all_ = got[0]
        for a, al in got[1:]:
            any_, all_ = op(any_, a), op(all_, al)
        return any_, all_
    traits = ms[0].traits or UNKNOWN
    for m in ms[1:]:
        traits = traits.combine(m.traits or UNKNOWN, both=op is np.logical_and)
    return MaskMod(combined, name=name, block_kinds=kinds, children=tuple(ms), traits=traits)


# ============================================================================================= score mods
@dataclasses.dataclass(frozen=True, eq=False)
class ScoreTraits:
    """What an engine may assume of a score mod without calling it: exactly one of the three is set.

    Attributes:
        bias_slopes: (H,) float64 — the mod is ``score + bias_slopes[h]·(kv_idx − q_idx)`` (ALiBi): a column term
            and a row term, ``m·(j − i) = m·(j − ρ) + m·(ρ − i)``, which a kernel may fold into its product.
        cap: the mod is ``cap·tanh(score / cap)`` (softcap): elementwise in the score alone, bounded by ±cap.
        chain: the mods applied in order (:func:`compose`), each judged by its own traits.
    """
    bias_slopes: np.ndarray | None = None
    cap: float | None = None
    chain: tuple = ()

    @property
    def elementwise(self) -> bool:
        """Whether the mod is a function of the score alone (no index): softcap, or a chain of such mods."""
        if self.chain:
            return all(m.traits is not None and m.traits.elementwise for m in self.chain)
        return self.cap is not None


class ScoreMod:
    """A score mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled scores.

    Args:
        fn: the function (operators and ufuncs on NumPy arrays).
        grad: ``grad(score, b, h, q_idx, kv_idx) -> ∂fn/∂score`` elementwise (same broadcasting), needed by
            :func:`qkv.flex_attention_backward`; None (and no ``vjp``): the backward refuses this mod.
        vjp: ``vjp(score, b, h, q_idx, kv_idx, grad_score) -> grad_score · ∂fn/∂score``, the vector-Jacobian
            product on a block (``grad_score`` the gradient of the loss with respect to the mod's output, the
            block's shape; the result its gradient with respect to ``score``, the same shape). The backward
            uses it instead of ``grad`` when given: for a mod whose derivative is cheaper as a product, or that
            must see the block's gradient (:mod:`qkv.torch` accumulates the gradients of the tensors a torch
            mod captures this way). Called from the engine's worker threads, one block at a time.
        name, params: what it is, for the explainer and ``repr``.
        validate: ``(B, H, L, S) -> None``, or None: raises ValueError naming the parameter when the mod cannot
            serve these sizes (ALiBi with fewer slopes than heads).
        traits: :class:`ScoreTraits` the mod promises (the built-ins declare theirs: a fused engine then applies
            them without calling ``fn``), or None: the engine calls ``fn`` on each block.

    The built-in mods record their own trace steps (``biased``, ``capped``); a custom one is recorded as
    ``modified``.
    """

    def __init__(self, fn, grad=None, *, vjp=None, name: str | None = None, params: dict | None = None,
                 records: bool = False, step_names: tuple = (), validate=None, traits: ScoreTraits | None = None):
        if not callable(fn):
            raise TypeError(f"score_mod: expected a callable (score, b, h, q_idx, kv_idx) -> score, got "
                            f"{type(fn).__name__}")
        if grad is not None and not callable(grad):
            raise TypeError(f"grad: expected a callable (score, b, h, q_idx, kv_idx) -> d/dscore or None, got "
                            f"{type(grad).__name__}")
        if vjp is not None and not callable(vjp):
            raise TypeError(f"vjp: expected a callable (score, b, h, q_idx, kv_idx, grad_score) -> grad_score or "
                            f"None, got {type(vjp).__name__}")
        self.fn, self._grad, self._vjp = fn, grad, vjp
        self.name = name or getattr(fn, "__name__", "score_mod")
        self.params = dict(params or {})
        self.records = records
        self.step_names = tuple(step_names)
        self._validate = validate
        if traits is not None and not isinstance(traits, ScoreTraits):
            raise TypeError(f"traits: expected a qkv.mods.ScoreTraits or None, got {type(traits).__name__}")
        self.traits = traits

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx)

    @property
    def has_grad(self) -> bool:
        """Whether the backward can go through this mod (it has ``grad`` or ``vjp``)."""
        return self._grad is not None or self._vjp is not None

    @property
    def has_vjp(self) -> bool:
        """Whether the backward uses :meth:`vjp` (given) rather than ``grad_score · grad``."""
        return self._vjp is not None

    def validate(self, B, H, L: int, S: int) -> None:
        """ValueError (naming the parameter) when this mod cannot serve B × H × L × S."""
        if self._validate is not None:
            self._validate(B, H, L, S)

    def grad(self, score, b, h, q_idx, kv_idx):
        """∂ score_mod(score) / ∂ score, elementwise."""
        if self._grad is None:
            raise ValueError(f"score_mod: {self.name} has no derivative, so its backward cannot be computed; "
                             "give one: qkv.mods.ScoreMod(fn, grad=lambda score, b, h, q_idx, kv_idx: ...)")
        return self._grad(score, b, h, q_idx, kv_idx)

    def vjp(self, score, b, h, q_idx, kv_idx, grad_score):
        """``grad_score · ∂ score_mod(score) / ∂ score``: the given ``vjp``, else the product with :meth:`grad`."""
        if self._vjp is not None:
            return self._vjp(score, b, h, q_idx, kv_idx, grad_score)
        return grad_score * self.grad(score, b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"{self.name}({inner})"


def as_score_mod(fn, name: str = "score_mod") -> ScoreMod:
    """A :class:`ScoreMod` for a plain callable (no derivative: forward only)."""
    if isinstance(fn, ScoreMod):
        return fn
    if not callable(fn):
        raise TypeError(f"{name}: expected a callable (score, b, h, q_idx, kv_idx) -> score, got "
                        f"{type(fn).__name__}")
    return ScoreMod(fn)


def call_score_mod(score_mod, s, b, h, q_idx, kv_idx, *, name: str = "score_mod") -> np.ndarray:
    """Apply a score mod and check what it returns: a float array of the scores' shape (a result that only
    broadcasts to it, e.g. a constant, is broadcast), cast to their dtype. Never NaN from finite scores."""
    out = score_mod(s, b, h, q_idx, kv_idx)
    if isinstance(out, numbers.Real) and not isinstance(out, bool):
        out = np.asarray(out, dtype=s.dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: expected it to return a numpy array of scores, got {type(out).__name__}")
    if out.dtype.kind != "f":
        raise TypeError(f"{name}: expected it to return floating scores (dtype {s.dtype}), got dtype {out.dtype}")
    if out.shape != s.shape:
        try:
            ok = np.broadcast_shapes(out.shape, s.shape) == s.shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{name}: expected a result of the scores' shape {s.shape}, got shape {out.shape}")
        out = np.broadcast_to(out, s.shape)
    out = out.astype(s.dtype, copy=False)
    if not (out < np.inf).all():                             # NaN or +inf somewhere (−inf removes a key: allowed)
        bad = ~(out < np.inf) & (s < np.inf)                 # … where the score itself was not NaN or +inf
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}: expected finite scores or −inf (−inf removes a key), got {out[at]} at "
                             f"index {at} for the score {s[at]}")
    return out


def score_mod_grad(score_mod, s, b, h, q_idx, kv_idx, *, name: str = "score_mod") -> np.ndarray:
    """``∂ score_mod / ∂ score`` as an array broadcastable to ``s``; ValueError if the mod has none."""
    if not isinstance(score_mod, ScoreMod) or score_mod._grad is None:
        label = score_mod.name if isinstance(score_mod, ScoreMod) else getattr(score_mod, "__name__", "it")
        raise ValueError(f"{name}: {label} has no derivative, so the backward cannot be computed; wrap it "
                         "with qkv.mods.ScoreMod(fn, grad=lambda score, b, h, q_idx, kv_idx: ...)")
    g = score_mod.grad(s, b, h, q_idx, kv_idx)
    if isinstance(g, (bool, np.bool_)) or not isinstance(g, (np.ndarray, numbers.Real)):
        raise TypeError(f"{name}: its grad returned {type(g).__name__}, expected a numpy float array")
    g = np.asarray(g)
    if g.dtype.kind not in "fiu":
        raise TypeError(f"{name}: its grad returned dtype {g.dtype}, expected a float array")
    g = g.astype(s.dtype, copy=False)
    try:
        ok = np.broadcast_shapes(g.shape, s.shape) == s.shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name}: its grad returned shape {g.shape}, expected one broadcastable to "
                         f"{s.shape}")
    bad = None if np.isfinite(g).all() else ~np.isfinite(g) & np.isfinite(s)
    if bad is not None and bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: its grad returned {np.broadcast_to(g, s.shape)[at]} at index {at} for the "
                         f"finite score {np.broadcast_to(s, bad.shape)[at]}; expected finite derivatives")
    return g


def score_mod_vjp(score_mod, s, b, h, q_idx, kv_idx, ds, *, name: str = "score_mod") -> np.ndarray:
    """``ds · ∂ score_mod / ∂ score`` through the mod's ``vjp`` (``ds``: the gradient with respect to the mod's
    output, broadcastable with ``s``), checked: a float array of their broadcast shape, finite where ``ds`` is,
    in ``s``'s dtype."""
    shape = np.broadcast_shapes(np.shape(s), np.shape(ds))
    s, ds = np.broadcast_to(s, shape), np.broadcast_to(ds, shape)
    g = score_mod.vjp(s, b, h, q_idx, kv_idx, ds)
    if isinstance(g, (bool, np.bool_)) or not isinstance(g, (np.ndarray, numbers.Real)):
        raise TypeError(f"{name}: its vjp returned {type(g).__name__}, expected a numpy float array")
    g = np.asarray(g)
    if g.dtype.kind != "f":
        raise TypeError(f"{name}: its vjp returned dtype {g.dtype}, expected a float array")
    if g.shape != shape:
        raise ValueError(f"{name}: its vjp returned shape {g.shape}, expected the block's shape {shape}")
    bad = ~np.isfinite(g) & np.isfinite(ds)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: its vjp returned {g[at]} at index {at} for the finite gradient {ds[at]}; "
                         "expected finite gradients")
    return g.astype(s.dtype, copy=False)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's head slopes (Press et al. 2022): for H a power of two, ``m_h = 2^(−8(h+1)/H)``; otherwise the
    slopes of the nearest lower power of two n, followed by every other slope of 2n (the paper's rule, as
    in its code, BLOOM's and attention-gym's). (H,) float64."""
    H = _checks.positive_int(num_heads, "num_heads")

    def power_of_two(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    n = 2 ** int(math.floor(math.log2(H)))
    slopes = power_of_two(n)
    if n < H:
        slopes += power_of_two(2 * n)[0::2][:H - n]
    return np.asarray(slopes, dtype=np.float64)


def alibi(slopes) -> ScoreMod:
    """ALiBi: ``score + slopes[h] · (kv_idx − q_idx)`` (as attention-gym): a key j positions before the query
    loses ``m_h·(i − j)``. ``slopes`` (H,), e.g. :func:`alibi_slopes`. Records the step ``biased``. Traits: the
    bias with these slopes (``bias_slopes``)."""
    s = np.asarray(slopes)
    if s.dtype == np.bool_ or s.dtype.kind not in "fiu":
        raise TypeError(f"slopes: expected numbers, got dtype {s.dtype}")
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"slopes: expected shape (num_heads,), got {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError(f"slopes: expected finite numbers, got {s.tolist()}")
    s = s.astype(np.float64)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        m = s[h] if np.ndim(h) else s[int(h)]                               # (H, 1, 1) or ()
        bias = m * (kv_idx - q_idx)                                         # (…, Lb, Sb)
        return stages.add_bias(score, bias, name=Names.BIASED, formula="biased = scaled + m_h·(j − i)",
                               params={"slopes": s})

    def alibi_grad(score, b, h, q_idx, kv_idx):
        return np.ones((), score.dtype)

    def validate(B, H, L, S):
        # one per head; a single head (or an (L, E) input: h = 0) reads the first of any number
        if H is not None and (H > s.size or (H > 1 and H != s.size)):
            raise ValueError(f"slopes: expected one slope per query head (H={H}), got {s.size}")
    return ScoreMod(alibi_mod, alibi_grad, name="alibi", params={"slopes": s}, records=True,
                    step_names=(Names.BIASED,), validate=validate, traits=ScoreTraits(bias_slopes=s))


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2): ``cap · tanh(score / cap)``. Records the step ``capped``. Traits: the cap
    (elementwise, bounded by ±cap)."""
    if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, numbers.Real):
        raise TypeError(f"cap: expected a finite number > 0, got {type(cap).__name__} {cap!r}")
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"cap: expected a finite number > 0, got {cap!r}")
    if not 1e-30 <= cap <= 1e30:                               # float32 holds cap, 1/cap and score/cap
        raise ValueError(f"cap: expected a number in [1e-30, 1e30] (float32 must hold cap and 1/cap), got {cap!r}")
    cap = float(cap)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return stages.softcap(score, cap, name=Names.CAPPED)

    def softcap_grad(score, b, h, q_idx, kv_idx):
        t = np.tanh(score / np.asarray(cap, score.dtype))
        return 1 - t * t                                                    # d/ds c·tanh(s/c) = 1 − tanh²
    return ScoreMod(softcap_mod, softcap_grad, name="softcap", params={"cap": cap}, records=True,
                    step_names=(Names.CAPPED,), traits=ScoreTraits(cap=cap))


def compose(*score_mods) -> ScoreMod:
    """Apply score mods in order: ``compose(alibi(m), softcap(50))`` is ``softcap(alibi(score))``. Its
    derivative is the chain rule of theirs (available when each has one; a product of vector-Jacobian products
    when one of them has a ``vjp`` alone). Traits: the chain of mods."""
    if not score_mods:
        raise ValueError("compose: expected at least one score mod, got none")
    ms = [as_score_mod(m, f"compose[{i}]") for i, m in enumerate(score_mods)]

    def composed(score, b, h, q_idx, kv_idx):
        for i, m in enumerate(ms):
            score = call_score_mod(m, score, b, h, q_idx, kv_idx, name=f"compose[{i}]")
        return score

    def validate(B, H, L, S):
        for m in ms:
            m.validate(B, H, L, S)

    def composed_grad(score, b, h, q_idx, kv_idx):
        from qkv.core.tracing import trace as _no_trace                            # grads record nothing
        g = np.ones((), score.dtype)
        with _no_trace():
            for i, m in enumerate(ms):
                g = g * score_mod_grad(m, score, b, h, q_idx, kv_idx, name=f"compose[{i}]")
                score = call_score_mod(m, score, b, h, q_idx, kv_idx, name=f"compose[{i}]")
        return g
    def composed_vjp(score, b, h, q_idx, kv_idx, grad_score):
        from qkv.core.tracing import trace as _no_trace                            # grads record nothing
        inputs = []
        with _no_trace():
            for i, m in enumerate(ms):
                inputs.append(score)
                score = call_score_mod(m, score, b, h, q_idx, kv_idx, name=f"compose[{i}]")
            for i in reversed(range(len(ms))):                             # the chain rule, last mod first
                grad_score = score_mod_vjp(ms[i], inputs[i], b, h, q_idx, kv_idx, grad_score,
                                           name=f"compose[{i}]")
        return grad_score
    grad = composed_grad if all(m._grad is not None for m in ms) else None
    vjp = composed_vjp if grad is None and all(m.has_grad for m in ms) else None   # a child with a vjp alone
    steps = tuple(n for m in ms for n in (m.step_names if m.records else (Names.MODIFIED,)))
    return ScoreMod(composed, grad, vjp=vjp, name="compose", params={"mods": ms}, records=all(m.records for m in ms),
                    step_names=steps, validate=validate, traits=ScoreTraits(chain=tuple(ms)))
