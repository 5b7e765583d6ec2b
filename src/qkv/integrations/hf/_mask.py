"""qkv's mask function for transformers: a transformers ``mask_function`` (torch-written) → a qkv block mask.

transformers builds one mask per forward and mask kind (``create_causal_mask``, ``create_sliding_window_causal_mask``,
``create_bidirectional_mask``) by calling the mask function registered for the model's attention implementation
with the pattern as a ``mask_function(batch_idx, head_idx, q_idx, kv_idx)`` written in torch, the 2-D padding mask
(True = real token) and the query/key offsets of a cache. sdpa's mask function evaluates that pattern into a dense
(B, 1, L, S) tensor; :func:`mask_function` here returns a :class:`Mask` instead: the pattern as a qkv
:class:`~qkv.mods.MaskMod` and the :class:`~qkv.BlockMask` built from it, so a windowed layer costs what its window
costs (the engine skips the empty blocks, never masks the full ones).

The patterns transformers composes — causal, bidirectional, the sliding windows (causal and bidirectional), the
padding, and their ``and_masks`` / ``or_masks`` — become qkv mods that know their block structure from index ranges
alone (nothing (L, S)-sized is evaluated); a causal or windowed pattern without offsets is :func:`qkv.mods.causal` /
:func:`qkv.mods.sliding_window` itself. Any other pattern (chunked, packed sequences, a model's own overlay) runs as
written: the torch function called on each block's index tensors, exact, evaluated element by element.

Mask convention: True = may attend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qkv.core import mods
from qkv.core.blockmask import BlockMask, create_block_mask

#: The block edge of the block masks built here (qkv's and torch's default).
BLOCK_SIZE = 128


@dataclass(frozen=True)
class _Window:
    """Allowed where ``lo ≤ (q + q_offset) − (kv + kv_offset) ≤ hi`` (±inf allowed): causal, windows."""
    lo: float
    hi: float


@dataclass(frozen=True)
class _All:
    """Every key allowed (bidirectional)."""


@dataclass(frozen=True)
class _Padding:
    """Allowed where ``padding[b, kv + kv_offset]``; ``padding`` (B, ≥ S) bool, True = real token."""
    padding: np.ndarray


@dataclass(frozen=True)
class _Join:
    """``and_masks`` (both=True) or ``or_masks`` of the parts."""
    parts: tuple
    both: bool


@dataclass(frozen=True)
class _Torch:
    """A pattern qkv does not recognize: the torch function itself."""
    fn: object


class Mask:
    """What :func:`mask_function` gives every attention layer: a transformers mask as qkv's block structure.

    Attributes:
        block_mask: the :class:`qkv.BlockMask` (B or None, None, L, S) the attention runs with (None: no mask at
            all, every key visible).
        mask_mod: its :class:`qkv.mods.MaskMod` (None likewise), evaluated by the engine on partial blocks only.
        batch_size, q_length, kv_length: B, L, S.
        is_causal: the mask is exactly top-left causal (query i sees keys 0 … i, no padding): sdpa's
            ``is_causal``, which qkv's forward without gradients takes as such.
        shape: ``(B, 1, L, S)``, the shape sdpa's dense mask would have (some model code reads it).
    """

    def __init__(self, mask_mod, batch_size: int, q_length: int, kv_length: int, per_batch: bool,
                 is_causal: bool = False):
        self.mask_mod, self.is_causal = mask_mod, bool(is_causal)
        self.batch_size, self.q_length, self.kv_length = int(batch_size), int(q_length), int(kv_length)
        self.block_mask: BlockMask | None = None
        if mask_mod is not None:
            self.block_mask = create_block_mask(mask_mod, self.batch_size if per_batch else None, None,
                                                self.q_length, self.kv_length, BLOCK_SIZE=BLOCK_SIZE)

    @property
    def shape(self) -> tuple:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        """4, as sdpa's mask: transformers reads it to tell a prepared mask from a 2-D padding mask."""
        return 4

    def dense(self, rows=None) -> np.ndarray | None:
        """The mask as booleans (B or 1, 1, R, S), True = may attend: rows ``rows`` (default all L); None when
        there is no mask. Materializes R × S booleans: for weights of chosen rows, dropout, and the tests."""
        if self.mask_mod is None:
            return None
        rows = np.arange(self.q_length) if rows is None else np.asarray(rows, dtype=np.int64)
        B = (self.block_mask.B or 1)
        b = np.arange(B, dtype=np.int64).reshape(B, 1, 1, 1) if B > 1 else np.zeros((), np.int64)
        m = mods.call_mask_mod(self.mask_mod, b, np.zeros((), np.int64), rows[:, None],
                               np.arange(self.kv_length, dtype=np.int64)[None, :])
        return np.broadcast_to(m, (B, 1, len(rows), self.kv_length))

    def __repr__(self) -> str:
        return f"qkv.hf.Mask({self.block_mask!r})" if self.block_mask is not None else \
            f"qkv.hf.Mask(none, B={self.batch_size}, L={self.q_length}, S={self.kv_length})"


def mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs) -> Mask:
    """transformers' mask-interface signature (``AttentionMaskInterface``): the pattern ``mask_function``
    (torch-written, see the module), the 2-D padding ``attention_mask`` (B, ≥ kv_offset + S) (True = real token),
    the cache offsets → a :class:`Mask` (a :class:`Mask` passed as ``attention_mask`` — built in advance, as
    ``generate`` does for a static cache — comes back as it is). The other keywords (dtype, device, allow_is_causal_skip, config, …) are
    sdpa's and eager's and not needed."""
    from transformers import masking_utils as mu

    if isinstance(attention_mask, Mask):                  # prepared already (generate with a static cache)
        return attention_mask
    q_offset, kv_offset = _int(q_offset), _int(kv_offset)
    fn = mask_function if mask_function is not None else mu.causal_mask_function
    tree = _translate(fn, mu)
    padding = _padding(attention_mask, kv_length, kv_offset)
    if padding is not None:
        tree = _Join((tree, _Padding(padding)), both=True)
    tree = _simplify(tree)
    per_batch = _per_batch(tree)
    mod = _build(tree, q_offset, kv_offset, q_length, kv_length)
    causal = tree == _Window(0, math.inf) and q_offset == kv_offset
    return Mask(mod, batch_size, q_length, kv_length, per_batch, is_causal=causal)


def _int(x) -> int:
    return int(x.item()) if hasattr(x, "item") else int(x)


def _padding(attention_mask, kv_length: int, kv_offset: int) -> np.ndarray | None:
    """The 2-D padding mask as NumPy bool (B, kv_offset + S) (padded with False as transformers does), or None
    when it masks nothing."""
    if attention_mask is None:
        return None
    pad = np.asarray(attention_mask.detach().cpu().numpy(), dtype=bool)
    if pad.ndim != 2:
        raise ValueError(f"attention_mask: expected the 2-D padding mask (B, S), got shape {tuple(pad.shape)}")
    need = kv_length + kv_offset
    if pad.shape[1] < need:
        pad = np.pad(pad, ((0, 0), (0, need - pad.shape[1])))
    if pad[:, kv_offset:kv_offset + kv_length].all():
        return None
    return pad


# --------------------------------------------------------------------------------- torch pattern → tree
def _cells(fn) -> dict:
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}


def _translate(fn, mu):
    """The pattern tree of a transformers mask function; :class:`_Torch` for what is not recognized."""
    if fn is mu.causal_mask_function:
        return _Window(0, math.inf)
    if fn is mu.bidirectional_mask_function:
        return _All()
    qual, cells = getattr(fn, "__qualname__", ""), _cells(fn)
    if qual in ("and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask") and "mask_functions" in cells:
        return _Join(tuple(_translate(f, mu) for f in cells["mask_functions"]), both=qual.startswith("and"))
    if qual == "sliding_window_overlay.<locals>.inner_mask" and "sliding_window" in cells:
        return _Window(-math.inf, int(cells["sliding_window"]) - 1)            # kv > q − w
    if qual == "sliding_window_bidirectional_overlay.<locals>.inner_mask" and "sliding_window" in cells:
        w = int(cells["sliding_window"])
        return _Window(-w, w)                                                  # |q − kv| ≤ w
    if qual == "padding_mask_function.<locals>.inner_mask" and "padding_mask" in cells:
        return _Padding(np.asarray(cells["padding_mask"].detach().cpu().numpy(), dtype=bool))
    return _Torch(fn)


def _simplify(tree):
    """Windows joined by ``and`` become one window; ``and`` with everything drops it; a one-part join its part."""
    if not isinstance(tree, _Join):
        return tree
    parts = [_simplify(p) for p in tree.parts]
    if tree.both:
        if any(isinstance(p, _Join) and p.both for p in parts):
            parts = [q for p in parts for q in (p.parts if isinstance(p, _Join) and p.both else (p,))]
        windows = [p for p in parts if isinstance(p, _Window)]
        rest = [p for p in parts if not isinstance(p, (_Window, _All))]
        if windows:
            rest.insert(0, _Window(max(w.lo for w in windows), min(w.hi for w in windows)))
        parts = rest or [_All()]
    elif any(isinstance(p, _All) for p in parts):
        return _All()
    return parts[0] if len(parts) == 1 else _Join(tuple(parts), tree.both)


def _per_batch(tree) -> bool:
    """Whether the pattern depends on the batch row (padding, or a torch function that may)."""
    if isinstance(tree, _Join):
        return any(_per_batch(p) for p in tree.parts)
    return isinstance(tree, (_Padding, _Torch))


# --------------------------------------------------------------------------------------- tree → qkv mod
def _build(tree, q_offset: int, kv_offset: int, L: int, S: int):
    """The qkv :class:`~qkv.mods.MaskMod` of a pattern tree at these offsets (None: every key visible)."""
    if isinstance(tree, _All):
        return None
    if isinstance(tree, _Window):
        return _window(tree.lo, tree.hi, q_offset - kv_offset)
    if isinstance(tree, _Padding):
        return _padding_mod(tree.padding[:, kv_offset:kv_offset + S])
    if isinstance(tree, _Torch):
        return _torch_mod(tree.fn, q_offset, kv_offset)
    built = [_build(p, q_offset, kv_offset, L, S) for p in tree.parts]
    if tree.both:
        built = [m for m in built if m is not None]
        return None if not built else built[0] if len(built) == 1 else mods.and_masks(*built)
    if any(m is None for m in built):
        return None
    return mods.or_masks(*built)


def _window(lo: float, hi: float, shift: int) -> mods.MaskMod:
    """``lo ≤ i − j + shift ≤ hi`` as a mask mod on the local indices i, j; qkv's own causal and sliding window
    when the offsets cancel (their fused kernels), else a mod with the same traits and block kinds."""
    lo, hi = lo - shift, hi - shift
    if lo == 0 and hi == math.inf:
        return mods.causal()
    if lo == 0 and hi != math.inf:
        return mods.sliding_window(int(hi) + 1)

    def window_mask(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= lo) & (d <= hi)

    def kinds(q0, q1, k0, k1):
        d_min, d_max = q0 - (k1 - 1), (q1 - 1) - k0                      # (nQ, nK) range of i − j per block
        return (d_max >= lo) & (d_min <= hi), (d_min >= lo) & (d_max <= hi)
    traits = mods.MaskTraits(invariant=True, diagonal=lo <= 0 <= hi, causal=lo >= 0)
    return mods.MaskMod(window_mask, name="window", params={"lo": lo, "hi": hi}, block_kinds=kinds, traits=traits)


def _padding_mod(padding: np.ndarray) -> mods.MaskMod:
    """Keys allowed where ``padding[b, kv]`` (B, S): the real tokens of each batch row."""
    padding = np.ascontiguousarray(padding)
    B, S = padding.shape

    def padding_mask(b, h, q_idx, kv_idx):
        return padding[b, kv_idx]                                          # (…, 1, Sb)

    def kinds(q0, q1, k0, k1):
        starts = k0.reshape(-1)
        any_ = np.logical_or.reduceat(padding, starts, axis=1)            # (B, nK)
        all_ = np.logical_and.reduceat(padding, starts, axis=1)
        return any_[:, None, None, :], all_[:, None, None, :]             # (B, 1, 1, nK)

    def validate(Bn, Hn, L, S_):
        if (Bn or 1) != B or S_ != S:
            raise ValueError(f"attention_mask: built for B={B}, S={S}, used for B={Bn}, S={S_}")
    return mods.MaskMod(padding_mask, name="padding", params={"real_tokens": padding.sum(1).tolist()},
                        block_kinds=kinds, validate=validate, traits=mods.MaskTraits())


def _torch_mod(fn, q_offset: int, kv_offset: int) -> mods.MaskMod:
    """A torch-written mask function as a qkv mask mod: called with torch index tensors (offsets added), its
    result back as NumPy bool. Exact, evaluated element by element on the partial blocks."""
    import torch

    def torch_mask(b, h, q_idx, kv_idx):
        def t(a):
            return torch.from_numpy(np.array(a, dtype=np.int64))
        out = fn(t(b), t(h), t(q_idx) + q_offset, t(kv_idx) + kv_offset)
        return np.asarray(torch.as_tensor(out).cpu().numpy(), dtype=bool)
    return mods.MaskMod(torch_mask, name=getattr(fn, "__qualname__", "mask_function"))
