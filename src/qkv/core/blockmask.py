"""Block masks: which blocks of the (L, S) scores a mask mod leaves empty, full or partial — computed once.

``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128)`` cuts the scores into BLOCK_SIZE ×
BLOCK_SIZE blocks and classifies each (per batch row and head, or broadcast when B/H is None)::

    sliding_window(3), Q_LEN = KV_LEN = 8, BLOCK_SIZE = 2      ■ full   ◩ partial   · empty
        k: 0-1 2-3 4-5 6-7
    q 0-1   ◩   ·   ·   ·
      2-3   ◩   ◩   ·   ·
      4-5   ·   ◩   ◩   ·
      6-7   ·   ·   ◩   ◩

A built-in mod (:mod:`qkv.mods`) classifies from the blocks' index ranges alone (no element is evaluated);
any other mod is evaluated one block row at a time (memory B·H·BLOCK_SIZE·KV_LEN booleans at most). The
tiled engine skips empty blocks, never masks full ones, and evaluates the mask mod only on partial blocks;
the reference path asks :meth:`BlockMask.dense` for the whole mask. Nothing (L, S)-sized is kept.
"""
from __future__ import annotations

import math

import numpy as np

from qkv import _checks
from qkv.core.mods import MaskMod, as_mask_mod, call_mask_mod

#: Block kinds, as stored in :attr:`BlockMask.kinds`.
EMPTY, PARTIAL, FULL = 0, 1, 2


class BlockMask:
    """The block structure of a mask mod (see the module doc). Build with :func:`create_block_mask`.

    Attributes:
        mask_mod: the :class:`qkv.mods.MaskMod`.
        B, H: the batch rows and heads it was built for (None = the same for all, broadcast: the mask mod
            is then called with ``b = 0`` / ``h = 0``, and so it is when built for 1 and used for more).
        Q_LEN, KV_LEN, BLOCK_SIZE: the sizes.
        kinds: int8 array (B or 1, H or 1, ⌈Q_LEN/BLOCK_SIZE⌉, ⌈KV_LEN/BLOCK_SIZE⌉) of EMPTY/PARTIAL/FULL.
    """

    def __init__(self, mask_mod: MaskMod, B, H, Q_LEN: int, KV_LEN: int, BLOCK_SIZE: int, kinds: np.ndarray):
        self.mask_mod, self.B, self.H = mask_mod, B, H
        self.Q_LEN, self.KV_LEN, self.BLOCK_SIZE = Q_LEN, KV_LEN, BLOCK_SIZE
        self.kinds = kinds

    @property
    def shape(self) -> tuple:
        return (self.B, self.H, self.Q_LEN, self.KV_LEN)

    def sparsity(self) -> float:
        """Percentage of blocks that are empty (skipped)."""
        return 100.0 * float(np.mean(self.kinds == EMPTY))

    def check_sizes(self, lead: tuple, L: int, S: int, name: str = "block_mask") -> None:
        """ValueError unless this block mask was built for scores (…, L, S) with leading dims ``lead``."""
        if (self.Q_LEN, self.KV_LEN) != (L, S):
            raise ValueError(f"{name}: built for Q_LEN={self.Q_LEN}, KV_LEN={self.KV_LEN}, but the query has "
                             f"L={L} and the key S={S}; create it with create_block_mask(mask_mod, B, H, {L}, {S})")
        Bn = math.prod(lead[:-1]) if len(lead) > 1 else 1
        Hn = lead[-1] if lead else 1
        for what, built, have in (("B", self.B, Bn), ("H", self.H, Hn)):
            if built is not None and built != have and built != 1:
                raise ValueError(f"{name}: built for {what}={built}, but the input has {what}={have}")

    def _bh(self, b: int, h: int) -> tuple:
        return (b if self.kinds.shape[0] > 1 else 0, h if self.kinds.shape[1] > 1 else 0)

    def index_arrays(self, b: int, h: int):
        """``b``, ``h`` as the mask mod receives them for one batch row and head (0-d int arrays): 0 along a
        dimension it was built broadcast (None or 1), as its :attr:`kinds`."""
        return np.asarray(b if (self.B or 1) > 1 else 0), np.asarray(h if (self.H or 1) > 1 else 0)

    def kind(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int):
        """How rows i0…i1 × keys j0…j1 of batch row ``b``, head ``h`` are masked: ``"full"``, ``"partial"``
        or None (empty), from the blocks that cover the range."""
        bs = self.BLOCK_SIZE
        grid = self.kinds[self._bh(b, h)][i0 // bs:(i1 - 1) // bs + 1, j0 // bs:(j1 - 1) // bs + 1]
        if (grid == EMPTY).all():
            return None
        return "full" if (grid == FULL).all() else "partial"

    def block(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """The mask mod evaluated on rows i0…i1 × keys j0…j1: bool (i1 − i0, j1 − j0), True = may attend."""
        bb, hh = self.index_arrays(b, h)
        q_idx = np.arange(i0, i1, dtype=np.int64)[:, None]
        kv_idx = np.arange(j0, j1, dtype=np.int64)[None, :]
        m = call_mask_mod(self.mask_mod, bb, hh, q_idx, kv_idx)
        return np.broadcast_to(m, (i1 - i0, j1 - j0))

    def dense(self, lead: tuple | None = None, L: int | None = None, S: int | None = None) -> np.ndarray:
        """The whole mask, bool, broadcastable to ``lead + (L, S)`` (default the sizes it was built for).

        (B or 1, H or 1, L, S) for 2-D leading dims; for other leading shapes b is the flattened batch
        index and h the last leading axis. Materializes L·S booleans per head: for the reference path.
        """
        from qkv.core.pipeline import indices
        L = self.Q_LEN if L is None else L
        S = self.KV_LEN if S is None else S
        if lead is None:
            lead = (self.B or 1, self.H or 1)
        b, h, q_idx, kv_idx = indices(tuple(lead), L, S)
        if (self.B or 1) == 1:                       # built broadcast: b = 0 for every batch row (as kinds)
            b = np.zeros((), np.int64)
        if (self.H or 1) == 1:
            h = np.zeros((), np.int64)
        m = call_mask_mod(self.mask_mod, b, h, q_idx, kv_idx)
        return m

    def __repr__(self) -> str:
        return (f"BlockMask({self.mask_mod!r}, B={self.B}, H={self.H}, Q_LEN={self.Q_LEN}, KV_LEN={self.KV_LEN}, "
                f"BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.1f}%)")

    def to_string(self, b: int = 0, h: int = 0, limit: int = 32) -> str:
        """The block grid of one batch row and head as text: ■ full, ◩ partial, · empty."""
        sym = {EMPTY: "·", PARTIAL: "◩", FULL: "■"}
        g = self.kinds[self._bh(b, h)][:limit, :limit]
        return "\n".join(" ".join(sym[int(x)] for x in row) for row in g)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128) -> BlockMask:
    """Which BLOCK_SIZE × BLOCK_SIZE blocks of the scores ``mask_mod`` leaves empty, full or partial.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend), a :mod:`qkv.mods` mod or any callable.
        B, H: batch rows and heads to build it for, or None (the mask does not depend on b / h: broadcast).
        Q_LEN, KV_LEN: L and S.
        BLOCK_SIZE: the block edge (default 128, as torch).

    Returns:
        a :class:`BlockMask`, computed once, reusable by every call with these sizes.

    Raises:
        TypeError / ValueError naming the argument: sizes that are not positive integers, a ``mask_mod`` that
        is not callable, returns something other than a bool array broadcasting over (…, L, S), or cannot
        serve these sizes (``doc_ids`` of another length …).
    """
    mod = as_mask_mod(mask_mod, "mask_mod")
    Bn = None if B is None else _checks.positive_int(B, "B")
    Hn = None if H is None else _checks.positive_int(H, "H")
    L = _checks.positive_int(Q_LEN, "Q_LEN")
    S = _checks.positive_int(KV_LEN, "KV_LEN")
    bs = _checks.positive_int(BLOCK_SIZE, "BLOCK_SIZE")
    mod.validate(Bn, Hn, L, S)
    nq, nk = -(-L // bs), -(-S // bs)
    # the (B, H, nQ, nK) kinds and their int64/bool temporaries, ~24 bytes a cell
    _checks.fits(24.0 * (Bn or 1) * (Hn or 1) * nq * nk, "B × H × Q_LEN × KV_LEN / BLOCK_SIZE²")
    q0 = (np.arange(nq, dtype=np.int64) * bs)[:, None]                       # (nQ, 1)
    q1 = np.minimum(q0 + bs, L)
    k0 = (np.arange(nk, dtype=np.int64) * bs)[None, :]                       # (1, nK)
    k1 = np.minimum(k0 + bs, S)
    got = mod.block_kinds(q0, q1, k0, k1)
    kinds = None
    if got is not None:
        any_, all_ = (np.asarray(a, dtype=bool) for a in got)
        kinds = np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY)).astype(np.int8)
        while kinds.ndim < 4:
            kinds = kinds[None]
        if (Bn is None and kinds.shape[0] > 1) or (Hn is None and kinds.shape[1] > 1):
            kinds = None                                     # depends on b/h but built broadcast: evaluate
        else:
            kinds = np.ascontiguousarray(np.broadcast_to(
                kinds, (kinds.shape[0] if Bn is None else Bn, kinds.shape[1] if Hn is None else Hn, nq, nk)))
    if kinds is None:
        kinds = _evaluate_kinds(mod, Bn, Hn, L, S, bs)
    _check_in_range(mod, Bn, Hn, L, S)
    return BlockMask(mod, Bn, Hn, L, S, bs, kinds)


def _evaluate_kinds(mod, Bn, Hn, L, S, bs) -> np.ndarray:
    """Classify the blocks by evaluating the mask mod one row of blocks at a time."""
    nq, nk = -(-L // bs), -(-S // bs)
    b = np.zeros((), np.int64) if Bn is None else np.arange(Bn, dtype=np.int64)[:, None, None, None]
    h = np.zeros((), np.int64) if Hn is None else np.arange(Hn, dtype=np.int64)[None, :, None, None]
    kinds = np.empty((Bn or 1, Hn or 1, nq, nk), np.int8)
    kv_idx = np.arange(S, dtype=np.int64)[None, :]
    starts = np.arange(0, S, bs)
    for i in range(nq):
        q_idx = np.arange(i * bs, min((i + 1) * bs, L), dtype=np.int64)[:, None]
        m = call_mask_mod(mod, b, h, q_idx, kv_idx)
        m = np.broadcast_to(m, (Bn or 1, Hn or 1, q_idx.shape[0], S))
        rows_any = m.any(axis=2)                                             # (B, H, S)
        rows_all = m.all(axis=2)
        blk_any = np.logical_or.reduceat(rows_any, starts, axis=-1)          # (B, H, nK)
        blk_all = np.logical_and.reduceat(rows_all, starts, axis=-1)
        kinds[:, :, i] = np.where(blk_all, FULL, np.where(blk_any, PARTIAL, EMPTY))
    return kinds


def _check_in_range(mod, Bn, Hn, L, S) -> None:
    """Evaluate the mod once at the far corner, so a mod that cannot serve these sizes (e.g. doc_ids
    shorter than L) fails here, with its name, and not inside the engine."""
    try:
        b = np.asarray(0 if Bn is None else Bn - 1)
        h = np.asarray(0 if Hn is None else Hn - 1)
        call_mask_mod(mod, b, h, np.array([[L - 1]]), np.array([[S - 1]]))
    except IndexError as exc:
        raise ValueError(f"mask_mod: {mod!r} cannot serve Q_LEN={L}, KV_LEN={S} "
                         f"(B={Bn}, H={Hn}): {exc}") from None
