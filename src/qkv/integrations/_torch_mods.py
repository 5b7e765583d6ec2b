"""Torch mods on qkv's engine: score mods and mask mods written with torch operations, and torch's BlockMask.

qkv's engine calls a mod with NumPy arrays, one block at a time. :func:`score_mod` and :func:`mask_mod` wrap a
mod written for ``torch.nn.attention.flex_attention`` so that it receives torch tensors (``torch.from_numpy``:
no copy) and its result goes back as a NumPy array (``.numpy()``). Because qkv hands a mod whole blocks where
torch's vmap hands it scalars, a mod must broadcast — as mods written with operators, ``torch.where`` and
indexing do (``bias[h, q_idx - kv_idx]``).

**Gradients of captured tensors.** A score mod may capture tensors that require gradients (a learnable bias
table, a scalar temperature, an ``nn.Module``'s parameters): :func:`captured_tensors` finds them as torch's
flex lifts its captured buffers — in the mod's closure cells, the globals its code names, its defaults, a bound
method's object, a ``functools.partial``'s arguments, an ``nn.Module``'s parameters — and :mod:`qkv.torch`
passes them to its ``autograd.Function`` as inputs. In the backward, the mod's ``vjp``
(:class:`qkv.mods.ScoreMod`) runs it once more on each block with ``requires_grad``: ``torch.autograd.grad(out,
[score, *captured], grad_outputs=dS')`` gives the engine ``dS`` and adds each captured tensor's gradient to a
:class:`Accumulator` (under a lock: the tiled engine runs blocks on worker threads).

**torch's BlockMask** (:func:`block_mask_from_torch`): its block kinds are read from its indices; its mask mod,
called with torch tensors on the partial blocks, is kept per block; and a mask that the whole grid proves a
function of ``i − j`` (:func:`_as_offset_table`) becomes a table with :class:`qkv.mods.MaskTraits`, so the
engine caches its partial blocks as patterns, as it does for qkv's built-in mask mods.

Shape legend: B batch, H query heads, L queries, S keys.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
import types

import numpy as np
import torch

from qkv.core import mods
from qkv.core.blockmask import EMPTY, FULL, PARTIAL, BlockMask, create_block_mask

__all__ = ["Accumulator", "block_mask_from_torch", "captured_tensors", "mask_mod", "score_mod"]

#: How deep :func:`captured_tensors` follows references (closures of closures, containers, helpers).
_DEPTH = 6


def _tensor(a) -> torch.Tensor:
    """A NumPy array (or scalar) as a torch tensor, sharing its memory where NumPy allows writing to it (a
    broadcast view is read-only: that is copied)."""
    a = np.asarray(a)
    if not a.flags.writeable or any(st < 0 for st in a.strides):
        a = np.array(a)
    return torch.from_numpy(a)


def _indices(b, h, q_idx, kv_idx) -> tuple:
    return _tensor(b), _tensor(h), _tensor(q_idx), _tensor(kv_idx)


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


# ====================================================================================== captured tensors
def captured_tensors(fn) -> list:
    """The tensors with ``requires_grad`` that ``fn`` reaches: closure cells, the globals its code (and the code
    of functions defined in it) names, its defaults, a bound method's object, a ``functools.partial``'s
    arguments, lists/tuples/dicts of them, an ``nn.Module``'s parameters and buffers, a callable object's
    attributes — followed :data:`_DEPTH` references deep. Each tensor once, in the order found."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if depth > _DEPTH or id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes, int, float)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                found.setdefault(id(obj), obj)
            return
        for child in _children(obj):
            visit(child, depth + 1)

    visit(fn, 0)
    return list(found.values())


def _children(obj) -> list:
    """What :func:`captured_tensors` follows from ``obj``."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        out = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        out += [obj.__defaults__ or (), obj.__kwdefaults__ or {}]
        g = obj.__globals__
        out += [g[n] for n in _code_names(obj.__code__) if n in g]
        return out
    if isinstance(obj, (mods.ScoreMod, mods.MaskMod)):
        return [obj.fn]
    if callable(obj) and hasattr(obj, "__dict__"):                   # a callable object: its attributes
        return list(vars(obj).values())
    return []


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:                                               # an empty cell (not yet assigned)
        return False
    return True


def _code_names(code) -> set:
    """The global (and attribute) names ``code`` and the code objects defined in it use."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


#: The most bytes of per-block gradients an :class:`Accumulator` keeps to add in a fixed order (beyond: folded in
#: as they come, in float64 — the last bit of a float64 capture may then depend on the workers' timing).
KEEP_BYTES = 256 << 20


class Accumulator:
    """The gradients of the captured tensors, summed over the blocks in a fixed order: each block's contribution is
    kept under the block's place as the engine's workers deliver it (under a lock), and :meth:`result` adds them in
    the order of those places, in float64 — two identical runs give the same bits whatever the thread count and
    whichever worker finished first (up to :data:`KEEP_BYTES` of them; more are added as they come)."""

    def __init__(self, tensors: list):
        self.tensors = tensors
        self.parts: dict = {}
        self.kept = 0
        self.sums = [None] * len(tensors)
        self.lock = threading.Lock()

    def add(self, grads, place: tuple = ()) -> None:
        """One block's gradients (None where it did not use a tensor), under the block's ``place``."""
        grads = [None if g is None else g.detach().to(torch.float64) for g in grads]
        size = sum(g.numel() * 8 for g in grads if g is not None)
        with self.lock:
            if self.kept + size <= KEEP_BYTES:
                self.parts.setdefault(place, []).append(grads)
                self.kept += size
            else:
                self._fold(grads)

    def _fold(self, grads) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.sums[i] = g if self.sums[i] is None else self.sums[i] + g

    def result(self) -> list:
        """Each tensor's gradient in its own dtype (None where the mod never used it)."""
        for place in sorted(self.parts):
            for grads in self.parts[place]:
                self._fold(grads)
        self.parts, self.kept = {}, 0
        return [None if s is None else s.to(t.dtype) for s, t in zip(self.sums, self.tensors)]


def _place(b, h, q_idx, kv_idx) -> tuple:
    """A block's place, as the engine calls a mod on it (sortable): its batch rows', heads', queries' and keys'
    first index and count."""
    out: tuple = ()
    for a in (b, h, q_idx, kv_idx):
        a = np.asarray(a)
        out += (int(a.ravel()[0]) if a.size else -1, int(a.size))
    return out


@contextlib.contextmanager
def serial_torch():
    """torch's own intra-op threads off in this thread (an engine worker) while it runs a mod's backward: a captured
    tensor's gradient from an index (``bias[h, i - j]``) is a scatter-add that torch splits among its threads, in an
    order that changes from run to run (its last bits did); the workers are the parallelism. Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ========================================================================================== score mods
def score_mod(fn, captured: list, accumulator: Accumulator | None = None) -> mods.ScoreMod:
    """``fn`` (a torch score mod) as a :class:`qkv.mods.ScoreMod` on NumPy blocks. With ``accumulator`` it
    has a ``vjp`` that adds the gradients of ``captured`` (the accumulator's tensors) to it; without, it is
    forward only (traits none: the engine calls it on every block)."""
    name = _name(fn)

    def forward(score, b, h, q_idx, kv_idx):
        s = _tensor(score)
        with torch.no_grad():                                        # worker threads: grad mode is per thread
            out = fn(s, *_indices(b, h, q_idx, kv_idx))
        return _result(out, name, s)

    if accumulator is None:
        return mods.ScoreMod(forward, name=name)

    def vjp(score, b, h, q_idx, kv_idx, grad_score):
        leaf = _tensor(score).requires_grad_()                       # (…, Lb, Sb)
        with torch.enable_grad(), serial_torch():
            s = leaf.clone()                                         # a mod may work in place (score.mul_(…))
            out = fn(s, *_indices(b, h, q_idx, kv_idx))
            if not _checked(out, name, s).requires_grad:              # no path to the score or a capture
                return np.zeros(s.shape, score.dtype)
            out = torch.broadcast_to(out, s.shape)
            inputs = [leaf] + captured
            grads = torch.autograd.grad(out, inputs, grad_outputs=_tensor(grad_score).to(out.dtype),
                                        allow_unused=True)
        accumulator.add(grads[1:], _place(b, h, q_idx, kv_idx))
        return np.zeros(s.shape, score.dtype) if grads[0] is None else grads[0].numpy()

    return mods.ScoreMod(forward, vjp=vjp, name=name)


def _checked(out, name: str, s: torch.Tensor) -> torch.Tensor:
    """What a torch score mod returned, held to what torch's flex_attention accepts (it calls the mod on one score
    at a time, under vmap): a floating tensor with one value per score — the score's shape, or a 0-d tensor for
    all of them. A Python number or another shape (``s.sum(-1, keepdim=True)``) is refused."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"score_mod: expected {name} to return a torch tensor of scores (as torch's flex_attention "
                        f"does), got {type(out).__name__}")
    if not out.is_floating_point():
        raise TypeError(f"score_mod: expected {name} to return floating scores, got dtype {out.dtype}")
    if out.ndim and tuple(out.shape) != tuple(s.shape):
        raise ValueError(f"score_mod: expected {name} to return one score for each score it was given, shape "
                         f"{tuple(s.shape)}, got {tuple(out.shape)} (torch's flex_attention calls a mod on one score "
                         "at a time)")
    return out


def _result(out, name: str, s: torch.Tensor) -> np.ndarray:
    out = torch.broadcast_to(_checked(out, name, s).detach(), s.shape)
    return out.numpy() if out.dtype in (torch.float32, torch.float64) else out.float().numpy()


# =========================================================================================== mask mods
#: The most bytes of evaluated blocks one wrapped mask mod keeps (:func:`mask_mod`).
CACHE_BYTES = 64 << 20


def mask_mod(fn) -> mods.MaskMod:
    """``fn`` (a torch mask mod ``(b, h, q_idx, kv_idx) -> bool tensor``, True = may attend) as a
    :class:`qkv.mods.MaskMod` on NumPy index arrays (no traits: evaluated on every partial block).

    The engine asks for the same partial block once per head (when the mask does not depend on ``h``: a block
    mask built with H None) and again in the backward; each block's answer is kept (up to :data:`CACHE_BYTES`),
    keyed by ``b``, ``h`` and the block's index ranges, so the torch mod runs once per distinct block (992 → 63
    calls for a window of 256 at N = 4096, H = 8). The wrapper lives for one call of :mod:`qkv.torch`."""
    if isinstance(fn, mods.MaskMod):
        return fn
    name = _name(fn)
    cache: dict = {}
    room = [CACHE_BYTES]
    lock = threading.Lock()

    def numpy_mask(b, h, q_idx, kv_idx):
        key = _block_key(b, h, q_idx, kv_idx)
        got = cache.get(key) if key is not None else None
        if got is None:
            got = _evaluate(b, h, q_idx, kv_idx)
            if key is not None and got.nbytes <= room[0]:
                got.flags.writeable = False
                with lock:
                    cache[key] = got
                    room[0] -= got.nbytes
        return got

    def _evaluate(b, h, q_idx, kv_idx):
        with torch.no_grad():
            out = fn(*_indices(b, h, q_idx, kv_idx))
        if isinstance(out, bool):
            return np.asarray(out)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"mask_mod: expected {name} to return a torch bool tensor, got {type(out).__name__}")
        if out.dtype != torch.bool:
            raise TypeError(f"mask_mod: expected {name} to return dtype torch.bool (True = may attend), got "
                            f"{out.dtype}")
        return out.numpy().copy()
    numpy_mask.__name__ = name
    return mods.MaskMod(numpy_mask, name=name)


def _block_key(b, h, q_idx, kv_idx):
    """A hashable key for a block asked for by index ranges (``q_idx`` (Lb, 1) and ``kv_idx`` (1, Sb) runs of
    consecutive ints, as the engine passes them), or None for anything else (not cached)."""
    if not all(isinstance(a, np.ndarray) for a in (b, h, q_idx, kv_idx)) or b.size > 1 or h.size > 1:
        return None
    runs = []
    for a in (q_idx, kv_idx):
        flat = a.reshape(-1)
        if a.dtype.kind not in "iu" or flat.size == 0 or not np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
            return None
        runs.append((a.shape, int(flat[0])))
    return (b.shape, int(b.reshape(-1)[0]) if b.size else None, h.shape, int(h.reshape(-1)[0]) if h.size else None,
            *runs)


def block_mask_from_torch(bm, L: int, S: int) -> BlockMask:
    """A torch ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask``) as qkv's: its block
    kinds read from ``kv_num_blocks``/``kv_indices`` (partial) and ``full_kv_num_blocks``/``full_kv_indices``
    (full), the rest empty; its ``mask_mod`` called with torch tensors on the partial blocks. Blocks that are
    not square (``BLOCK_SIZE=(q, kv)`` with q ≠ kv) are classified again at 128 by evaluating the mask mod.
    (B, H) of size 1 broadcast, as in torch."""
    Lm, Sm = (int(x) for x in bm.seq_lengths)
    if (Lm, Sm) != (L, S):
        raise ValueError(f"block_mask: built for Q_LEN={Lm}, KV_LEN={Sm}, but the query has L={L} and the key "
                         f"S={S}; create it with create_block_mask(mask_mod, B, H, {L}, {S})")
    mod = mask_mod(bm.mask_mod)
    num = bm.kv_num_blocks.detach().cpu().numpy()                            # (B, H, nQ)
    B, H = num.shape[:2]
    Bn, Hn = (None if B == 1 else B), (None if H == 1 else H)
    qbs, kbs = (bm.BLOCK_SIZE, bm.BLOCK_SIZE) if isinstance(bm.BLOCK_SIZE, int) else bm.BLOCK_SIZE
    if qbs != kbs:
        return create_block_mask(mod, Bn, Hn, L, S, BLOCK_SIZE=128)
    bs = int(qbs)
    kinds = np.zeros((B, H, math.ceil(L / bs), math.ceil(S / bs)), np.int8)  # EMPTY everywhere, then marked
    _mark(kinds, num, bm.kv_indices, PARTIAL)
    if bm.full_kv_num_blocks is not None:
        _mark(kinds, bm.full_kv_num_blocks.detach().cpu().numpy(), bm.full_kv_indices, FULL)
    if B == 1 and H == 1:
        mod = _as_offset_table(mod, kinds[0, 0], L, S, bs) or mod
    return BlockMask(mod, Bn, Hn, L, S, bs, kinds)


def _as_offset_table(mod: mods.MaskMod, grid: np.ndarray, L: int, S: int, bs: int):
    """The mask as a function of ``i − j`` with its :class:`qkv.mods.MaskTraits`, when the whole (L, S) grid
    proves it one — else None.

    A torch mask mod declares no traits, so the engine would call it on every partial block, never cache its
    partial blocks as patterns nor batch a window's bands. Here each partial block is evaluated once (through
    ``mod``, whose cache the engine then reads) and every cell's value is checked against a table ``f(i − j)``,
    the full blocks' offsets against 1 and the empty ones' against 0: every cell of the grid agrees, or this
    gives up. The table then answers the engine (``invariant``), and says whether the mask allows the diagonal
    and nothing above it (``diagonal``, ``causal``)."""
    table = np.full(L + S - 1, -1, np.int8)                  # f(d) at d + S − 1 (d = i − j); −1: not yet seen
    zero = np.zeros((), np.int64)
    for qi, kj in zip(*np.nonzero(grid == PARTIAL)):
        i = np.arange(qi * bs, min(qi * bs + bs, L), dtype=np.int64)[:, None]
        j = np.arange(kj * bs, min(kj * bs + bs, S), dtype=np.int64)[None, :]
        a = np.broadcast_to(mods.call_mask_mod(mod, zero, zero, i, j), (i.size, j.size))
        if not np.array_equal(a[1:, 1:], a[:-1, :-1]):        # one offset (a diagonal), two values
            return None
        # its offsets i0 − j1 + 1 … i1 − 1 − j0, one run: the first row backwards, then the first column
        run = np.concatenate([a[0, ::-1], a[1:, 0]]).astype(np.int8)
        lo = int(i[0, 0] - j[0, -1]) + (S - 1)
        seen = table[lo:lo + run.size]
        if ((seen != -1) & (seen != run)).any():
            return None
        seen[...] = run
    for kind, value in ((FULL, 1), (EMPTY, 0)):
        covered = _offsets(np.nonzero(grid == kind), L, S, bs)
        if ((table != -1) & (table != value) & covered).any():
            return None
        table[covered] = value
    allowed = table == 1
    traits = mods.MaskTraits(invariant=True, diagonal=bool(allowed[S - 1]), causal=not allowed[:S - 1].any())
    fn = mod.fn

    def offset_mask(b, h, q_idx, kv_idx):
        d = np.subtract(q_idx, kv_idx) + (S - 1)
        if d.size and (d.min() < 0 or d.max() >= table.size):   # beyond the grid: ask the mod itself
            return fn(b, h, q_idx, kv_idx)
        return allowed[d]
    offset_mask.__name__ = mod.name
    offset_mask.top_left_causal = bool(allowed[S - 1:].all() and not allowed[:S - 1].any())   # exactly i ≥ j
    return mods.MaskMod(offset_mask, name=mod.name, traits=traits)


def is_causal(block_mask) -> bool:
    """Whether ``block_mask`` (from :func:`block_mask_from_torch`) is exactly the top-left causal mask ``i ≥ j``,
    proven on its whole grid: then ``is_causal`` computes the same thing on the engine's plain causal loops."""
    fn = getattr(getattr(block_mask, "mask_mod", None), "fn", None)
    return bool(getattr(fn, "top_left_causal", False))


def _offsets(blocks, L: int, S: int, bs: int) -> np.ndarray:
    """Which offsets ``i − j`` (at d + S − 1) the blocks (qi, kj) cover: each block's cells span one run of them."""
    qi, kj = blocks
    lo = qi * bs - (np.minimum(kj * bs + bs, S) - 1) + (S - 1)
    hi = np.minimum(qi * bs + bs, L) - 1 - kj * bs + (S - 1)
    edges = np.zeros(L + S, np.int64)
    np.add.at(edges, lo, 1)
    np.add.at(edges, hi + 1, -1)
    return np.cumsum(edges)[:-1] > 0


def _mark(kinds: np.ndarray, num: np.ndarray, indices, kind: int) -> None:
    """``kinds[b, h, i, indices[b, h, i, :num[b, h, i]]] = kind`` (blocks past the grid ignored)."""
    idx = indices.detach().cpu().numpy()                                      # (B, H, nQ, K)
    valid = np.arange(idx.shape[-1]) < num[..., None]
    b, h, i, slot = np.nonzero(valid)
    col = idx[b, h, i, slot]
    keep = (i < kinds.shape[2]) & (col >= 0) & (col < kinds.shape[3])
    kinds[b[keep], h[keep], i[keep], col[keep]] = kind
