"""Block-sparse tasks at their work fraction: a block mask's cells as blocks of the compiled plain loop.

A block mask (:func:`qkv.create_block_mask`) says, per cell of the engine's grid (:meth:`_Problem.grid`), whether
no key, every key or some keys of the cell are allowed. With the compiled loop (:func:`qkv._jit.plain_rows`), a
task's *full* cells are plain blocks — the same loop, the same GEMMs and exponentials as unmasked attention —
merged into rectangles as tall and wide as the grid allows; each *partial* cell is a block of its own whose
mask, evaluated once per block mask (per offset, for a mask that depends on ``i − j`` alone), is a 0/1 *tile*
multiplying its probabilities; *empty* cells cost nothing. So a sliding window computes its band and two
half-masked cells a row, a packed document its squares, a prefix-LM its prefix and its triangle — no Python
per block, no mask applied where none is needed.

The plan of a task (its blocks and tiles) depends on the block mask, the head's (b, h) and the task's rows: made
once, kept with the block mask (:meth:`qkv.backends.runtime.Runtime.plans`).
"""
from __future__ import annotations

import numpy as np

from ...kernels import NO_MASK as _NO_MASK
from ...mods import call_mask_mod
from .plan import _banded

#: A task whose tiles would exceed this many bytes keeps the other strategies (a mask with partial cells
#: everywhere — a random one — gains nothing from tiles).
MAX_TILE_BYTES = 16 << 20


def masked_plan(P, idx, i0: int, i1: int, g: int, width: int):
    """The compiled loop's blocks for a task of a block-mask problem: ``(plan, tiles, room)`` or None.

    ``plan`` (n, 7) int64 rows ``(r0, r1, j0, j1, d, fresh, tile)`` as :func:`qkv._jit.plain_rows` takes them
    (rows of the task's ``qs``: positions × ``g``), ``tiles`` (T, cell, cell) float32, ``room`` the largest
    block's scores. The cells are covered by :func:`_quad` (full rectangles at most ``width`` keys wide). None
    where an ``attn_mask`` takes part (a float one may add, not only remove) or the
    tiles would pass :data:`MAX_TILE_BYTES`.
    """
    if P.mask is not None:
        return None
    b, h = P.bh(idx)
    key = ("tiles", P.cell, P.is_causal, P.bm._bh(b, h), i0, i1, g, width, P.limits.band_rows_plain,
           P.limits.band_keys_plain)
    got = P._bm_cache.get(key)
    if got is None:
        got = _build(P, idx, i0, i1, g, width)
        P._bm_cache[key] = got
    return None if got[0] is None else got


def _build(P, idx, i0: int, i1: int, g: int, width: int):
    b, h = P.bh(idx)
    G = P.grid(idx)[0]                                        # (cells of L, cells of S) −1 / 0 / mask bits
    c, L, S = P.cell, P.L, P.S
    gr0, gr1 = i0 // c, -(-i1 // c)
    sub = G[gr0:gr1]
    cols = np.flatnonzero((sub >= 0).any(axis=0))
    rects: list = []
    if cols.size:                                             # (no attn_mask: masked_plan returned None)
        _quad(sub, 0, gr1 - gr0, int(cols[0]), int(cols[-1]) + 1, max(1, width // c), rects)
    tiles, index, blocks = [], {}, []
    for ra, rb, ca, cb in rects:
        a0, a1 = max((gr0 + ra) * c, i0), min((gr0 + rb) * c, i1, L)
        j0, j1 = ca * c, min(cb * c, S)
        if a0 >= a1 or j0 >= j1:
            continue
        v = int(sub[ra, ca])
        if v == 0:
            blocks.append((a0, a1, j0, j1, -1))
            continue
        got = _tile(P, b, h, v, a0, a1, j0, j1, tiles, index)
        if got is None:
            return None, None, 0
        t, (u0, u1, w0, w1) = got
        if t != -2:                                           # −2: nothing allowed in the cell
            blocks.append((a0 + u0, a0 + u1, j0 + w0, j0 + w1, t))
    plan = _banded(P, [(a0 - i0, a1 - i0, j0, j1, _NO_MASK) for a0, a1, j0, j1, t in blocks], g,
                   [t for *_, t in blocks])                  # full rectangles in the loop's small pieces
    stack = np.zeros((max(1, len(tiles)), c, c), np.float32)
    for t, tile in enumerate(tiles):
        stack[t, :tile.shape[0], :tile.shape[1]] = tile
    room = int(((plan[:, 1] - plan[:, 0]) * (plan[:, 3] - plan[:, 2])).max(initial=1))
    return plan, stack, room


def _quad(G: np.ndarray, ra: int, rb: int, ca: int, cb: int, width: int, out: list) -> None:
    """Cells ra … rb × ca … cb of the grid as rectangles ``(ra, rb, ca, cb)`` into ``out``: none where every
    cell is empty, one where every cell is full (at most ``width`` cells wide), one per partial cell; else
    halved along the longer side — so a band's or a triangle's edge is covered by squares that shrink towards
    it, and its inside by as few, as large rectangles as the grid allows."""
    sub = G[ra:rb, ca:cb]
    if (sub < 0).all():
        return
    if (sub == 0).all() and cb - ca <= width:
        out.append((ra, rb, ca, cb))
        return
    if rb - ra == 1 and cb - ca == 1:
        out.append((ra, rb, ca, cb))                          # a partial cell: its tile
        return
    if rb - ra >= cb - ca:
        m = ra + (rb - ra) // 2
        _quad(G, ra, m, ca, cb, width, out)
        _quad(G, m, rb, ca, cb, width, out)
    else:
        m = ca + (cb - ca) // 2
        _quad(G, ra, rb, ca, m, width, out)
        _quad(G, ra, rb, m, cb, width, out)


def _tile(P, b, h, v: int, a0, a1, j0, j1, tiles: list, index: dict):
    """The 0/1 tile of cell rows a0 … a1 × keys j0 … j1 (``v``'s bits: 1 the mask mod, 2 ``is_causal``),
    cropped to the rows and keys where anything is allowed: ``(t, (u0, u1, w0, w1))`` — the tile's index (−1:
    all of the crop allowed, no tile; −2: nothing allowed) and the crop within the cell. Made once per task
    plan, once per offset where the mask depends on ``i − j`` alone. A sink's cell (4 keys of 64) is then a
    block of 4 keys; None where the tiles would pass :data:`MAX_TILE_BYTES`."""
    inv = P.mask_traits.invariant
    key = (v, a0 - j0, a1 - a0, j1 - j0) if inv else (v, a0, j0)
    got = index.get(key)
    if got is not None:
        return got
    allowed = np.ones((a1 - a0, j1 - j0), bool)
    q = np.arange(a0, a1, dtype=np.int64)[:, None]
    kv = np.arange(j0, j1, dtype=np.int64)[None, :]
    if v & 1:
        mb, mh = P.bm.index_arrays(b, h)
        allowed &= np.broadcast_to(call_mask_mod(P.bm.mask_mod, mb, mh, q, kv), allowed.shape)
    if v & 2:
        allowed &= kv <= q                                   # top-left causal, as the engine's grid
    rows, cols = np.flatnonzero(allowed.any(axis=1)), np.flatnonzero(allowed.any(axis=0))
    if rows.size == 0:
        got = (-2, (0, 0, 0, 0))
    else:
        crop = (int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1)
        part = allowed[crop[0]:crop[1], crop[2]:crop[3]]
        if part.all():
            got = (-1, crop)
        elif (len(tiles) + 1) * P.cell * P.cell * 4 > MAX_TILE_BYTES:
            return None
        else:
            tiles.append(part.astype(np.float32))
            got = (len(tiles) - 1, crop)
    index[key] = got
    return got
