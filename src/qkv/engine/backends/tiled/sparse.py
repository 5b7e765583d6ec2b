"""Block-sparse tasks at their work fraction: a block mask's cells as pieces of the compiled plain loop.

A block mask (:func:`qkv.create_block_mask`) says, per cell of the engine's grid (:meth:`_Problem.grid`), whether
no key, every key or some keys of the cell are allowed. With the compiled loop (:func:`qkv.compute._jit.plain_rows`), a
task's *full* cells are plain pieces — the same loop, the same GEMMs and exponentials as unmasked attention;
*empty* cells cost nothing; a *partial* cell that is a band in i − j (``lo ≤ j − i ≤ hi``: a sliding window's
edges, a causal diagonal) joins the full cells of its row into one run of keys, cut in strips of
``strip_rows_tiles`` query positions whose edges the loop masks as it exponentiates (its ``d`` and ``lo``); any
other partial cell is a piece of its own whose mask, evaluated once per block mask, is a 0/1 *tile* multiplying
its probabilities. So a sliding window computes its band and two thin triangles a strip, a packed document its
squares, a prefix-LM its prefix and its triangle — no Python per block, no mask applied where none is needed.

The plan of a task (its pieces and tiles) depends on the block mask, the head's (b, h), the task's rows and the
limits it is cut by: made once, kept with the block mask (:meth:`qkv.backends.runtime.Runtime.plans`).
"""
from __future__ import annotations

import numpy as np

from qkv.compute.kernels import NO_LO, NO_MASK as _NO_MASK
from qkv.core.mods import call_mask_mod

#: A task whose tiles would exceed this many bytes keeps the other strategies (a mask with partial cells
#: everywhere — a random one — gains nothing from tiles).
MAX_TILE_BYTES = 16 << 20
#: Full blocks at most this many keys wide (a sink's column) are cut in tall pieces, not a cell's rows at a time.
NARROW = 16
_MISSING = object()


def masked_plan(P, idx, i0: int, i1: int, g: int, width: int):
    """The compiled loop's blocks for a task of a block-mask problem: ``(plan, tiles, room, strips)`` or None.

    ``plan`` (n, 9) int64 rows ``(r0, r1, j0, j1, d, fresh, tile, lo, t0)`` as :func:`qkv.compute._jit.plain_rows` takes
    them (rows of the task's ``qs``: positions × ``g``; ``t0`` the tile's row origin, in positions), ``tiles`` (T, cell, cell) float32, ``room`` the largest
    piece's scores, ``strips`` whether any piece masks a band's edge. The cells are covered by :func:`_quad`
    (full rectangles at most ``width`` keys wide). None where an ``attn_mask`` takes part (a float one may add,
    not only remove) or the tiles would pass :data:`MAX_TILE_BYTES`.
    """
    if P.mask is not None:
        return None
    b, h = P.bh(idx)
    lim = P.limits
    key = ("tiles", P.cell, P.is_causal, P.bm._bh(b, h), i0, i1, g, width, lim.band_rows_plain, lim.band_keys_plain,
           lim.strip_rows_tiles)
    got = P._bm_cache.get(key, _MISSING)
    if got is _MISSING:                                       # (None: made, and refused)
        got = P._bm_cache[key] = _build(P, idx, i0, i1, g, width)
    return got


def _build(P, idx, i0: int, i1: int, g: int, width: int):
    """:func:`masked_plan`'s result, made (None: the tiles would pass :data:`MAX_TILE_BYTES`)."""
    b, h = P.bh(idx)
    G = P.grid(idx)[0]                                        # (cells of L, cells of S) −1 / 0 / mask bits
    c, S = P.cell, P.S
    gr0, gr1 = i0 // c, -(-i1 // c)
    sub = G[gr0:gr1]
    cols = np.flatnonzero((sub >= 0).any(axis=0))
    rects: list = []
    if cols.size:                                             # (no attn_mask: masked_plan returned None)
        _quad(sub, 0, gr1 - gr0, int(cols[0]), int(cols[-1]) + 1, max(1, width // c), rects)
    tiles, index, segs = [], {}, []
    for ra, rb, ca, cb in rects:
        a0, a1 = max((gr0 + ra) * c, i0), min((gr0 + rb) * c, i1)
        j0, j1 = ca * c, min(cb * c, S)                     # (never empty: each rect has a row and a key here)
        v = int(sub[ra, ca])
        if v == 0:
            segs.append((a0, a1, j0, j1, -1, None, None))
            continue
        got = _tile(P, b, h, v, a0, a1, j0, j1, tiles, index)
        if got is None:
            return None
        t, (u0, u1, w0, w1) = got
        if t == -3:                                           # a band in i − j: its edges, no tile
            lo, hi = (None if e is None else e + j0 - a0 for e in (u0, u1))       # key − position, absolute
            segs.append((a0, a1, j0, j1, -1, lo, hi))
        elif t != -2:                                         # −2: nothing allowed in the cell
            segs.append((a0 + u0, a0 + u1, j0 + w0, j0 + w1, t, None, None))
    plan = _assemble(P, _pieces(P, segs, c), i0, g)
    stack = np.zeros((max(1, len(tiles)), c, c), np.float32)
    for t, tile in enumerate(tiles):
        stack[t, :tile.shape[0], :tile.shape[1]] = tile
    room = int(((plan[:, 1] - plan[:, 0]) * (plan[:, 3] - plan[:, 2])).max(initial=1))
    return plan, stack, room, bool((plan[:, 7] != NO_LO).any() or (plan[:, 4] != _NO_MASK).any())


def _pieces(P, segs: list, cell: int) -> list:
    """The loop's pieces ``(a, b, j0, j1, D, t, LO)`` (positions; D and LO a band's edges as key − position, None
    where they bind nowhere) of a task's segments (cells and rectangles of cells, as ``segs``): a narrow full
    block (a sink's column) in tall pieces (:func:`_tall`); the rest a cell's rows at a time, where the full
    rectangles and a band's edge cells of one cell row join into one run (a sliding window's row of cells:
    one run, both edges in it) cut in pieces of about a ``band_rows_plain`` × ``band_keys_plain`` piece's
    scores, its lower edge's triangle a piece of its own (:func:`_cut`)."""
    narrow, rows = [], {}
    for a0, a1, j0, j1, t, lo, hi in segs:
        if t < 0 and lo is None and hi is None and j1 - j0 <= NARROW:
            narrow.append((a0, a1, j0, j1))
            continue
        a = a0
        while a < a1:                                         # a cell row at a time (a tile's crop: one cell)
            b = min((a // cell + 1) * cell, a1)               # (to the next cell's start: a0 may be mid-cell)
            rows.setdefault((a, b), []).append((j0, j1, t, lo, hi))
            a = b
    out = _tall(P, narrow)
    area = P.limits.band_rows_plain * P.limits.band_keys_plain          # (sizes: positive, thresholds.limits)
    strip = P.limits.strip_rows_tiles
    for (a, b), row in rows.items():
        run = None
        for j0, j1, t, lo, hi in sorted(row):
            if t >= 0:
                out.append((a, b, j0, j1, None, t, None))
                continue
            if run is not None and _joins(run, (j0, j1, lo, hi), a, b):
                run = (run[0], j1, run[2], hi)
                continue
            if run is not None:
                out += _cut(a, b, run, strip, area)
            run = (j0, j1, lo, hi)
        if run is not None:
            out += _cut(a, b, run, strip, area)
    return out


def _joins(left: tuple, right: tuple, a: int, b: int) -> bool:
    """Whether runs ``(j0, j1, LO, D)`` of rows a … b that touch are one run: the left's upper edge and the
    right's lower edge bind nowhere, and neither's other edge binds in the other's keys."""
    j0, j1, lo, hi = left
    k0, k1, lo2, hi2 = right
    return (j1 == k0 and hi is None and lo2 is None and (lo is None or k0 >= b - 1 + lo)
            and (hi2 is None or j1 - 1 <= a + hi2))


def _cut(a: int, b: int, run: tuple, strip: int, area: int) -> list:
    """A run ``(j0, j1, LO, D)`` of rows a … b in strips of ``strip`` rows, each in pieces: the lower edge's
    triangle first (its keys from a multiple of 16 down — not below j0 —, masked, to the first key every row of
    the strip takes), then pieces of ``area`` scores at most, the last to a multiple of 16 where the upper edge masks the
    keys added; none where nothing is allowed; each piece with the run's edges (:func:`_assemble` drops those that
    bind nowhere in it)."""
    j0, j1, lo, hi = run
    out = []
    for x0 in range(a, b, strip):
        x1 = min(x0 + strip, b)
        # (rounded to multiples of 16 for the GEMM, but never past the run's own keys: a cell of BLOCK_SIZE 8 or 24
        # starts between multiples of 16, and the keys before it belong to the run or piece of the cell before)
        start = max(j0, max(j0, x0 + lo) // 16 * 16) if lo is not None else j0
        end = min(j1, -(-min(j1, x1 + hi) // 16) * 16) if hi is not None else j1
        cuts = [start]
        if lo is not None and x1 - 1 + lo > start:
            cuts.append(min(end, -(-(x1 - 1 + lo) // 16) * 16))
        step = max(16, area // (x1 - x0) // 16 * 16)
        while cuts[-1] < end:
            cuts.append(min(end, cuts[-1] + step))
        for p0, p1 in zip(cuts, cuts[1:]):
            if (hi is not None and p0 > x1 - 1 + hi) or (lo is not None and p1 - 1 < x0 + lo):
                continue                                       # nothing of the strip's band in it
            out.append((x0, x1, p0, p1, hi, -1, lo))           # (_assemble keeps an edge where it binds)
    return out


def _tall(P, narrow: list) -> list:
    """Narrow full blocks (a sink's column of cells), those of the same keys that touch joined, in pieces of
    about a ``band_rows_plain`` × ``band_keys_plain`` piece's scores: one block a cell, whose tiny products
    cost more than their arithmetic, was 4 % of a sliding window's time."""
    bh, bw = P.limits.band_rows_plain, P.limits.band_keys_plain
    joined: list = []
    for a0, a1, j0, j1 in sorted(narrow, key=lambda x: (x[2], x[3], x[0])):
        if joined and joined[-1][2:] == (j0, j1) and joined[-1][1] == a0:
            joined[-1] = (joined[-1][0], a1, j0, j1)
        else:
            joined.append((a0, a1, j0, j1))
    out = []
    for a0, a1, j0, j1 in joined:
        rh = bh * max(1, bw // (j1 - j0))
        a = a0
        while a < a1:
            b = min(a - a % rh + rh, a1)
            out.append((a, b, j0, j1, None, -1, None))
            a = b
    return out


def _assemble(P, pieces: list, i0: int, g: int) -> np.ndarray:
    """The plan rows ``(r0, r1, j0, j1, d, fresh, tile, lo, t0)`` of ``pieces`` (positions from ``i0``; rows of
    the task's ``qs``, positions × ``g``): band by band (``band_rows_plain``), the tallest pieces first, so that a
    piece's rows are all new (``fresh``: its P·V written, not added) or all seen — split where they are not. A
    split piece's later parts keep their place in the tile (``t0``: the part's first row within it) and on
    the band's edges (``d``, ``lo`` moved with the rows)."""
    bh = P.limits.band_rows_plain
    pieces = sorted(pieces, key=lambda x: (x[0] // bh, x[0] - x[1], x[0], x[2]))
    n = max((p[1] for p in pieces), default=i0) - i0
    seen = np.zeros(max(n, 0) + 1, bool)
    rows = []
    for a, b, j0, j1, hi, t, lo in pieces:
        r0, r1 = a - i0, b - i0
        # the diagonal offsets as the kernel reads them: key j0 + c for row r0 + r where lo ≤ c − r ≤ d
        d = _NO_MASK if hi is None else hi + a - j0
        low = NO_LO if lo is None else lo + a - j0
        edges = np.flatnonzero(np.diff(seen[r0:r1].astype(np.int8))) + 1
        for s0, s1 in zip([0, *edges], [*edges, r1 - r0]):  # (one run but where rows are half seen)
            # an edge only where it binds in the part: the upper in its first row, the lower in its last
            dd = _NO_MASK if d == _NO_MASK or d + s0 >= j1 - j0 - 1 else d + s0
            ll = NO_LO if low == NO_LO or low + s1 - 1 <= 0 else low + s0
            rows.append((g * (r0 + s0), g * (r0 + s1), j0, j1, dd, int(not seen[r0 + s0]), t, ll, s0))
        seen[r0:r1] = True
    return np.array(rows, np.int64).reshape(-1, 9)


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
    all of the crop allowed, no tile; −2: nothing allowed) and the crop within the cell; or ``(−3, (lo, hi,
    None, None))`` where the cell is a band in i − j (:func:`_band`), its edges as key − position from the
    cell's corner (None: binds nowhere in it). Made once per task plan, once per offset where the mask depends
    on ``i − j`` alone; equal tiles are one. None where the tiles would pass :data:`MAX_TILE_BYTES`."""
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
    band = _band(allowed) if rows.size else None
    if rows.size == 0:
        got = (-2, (0, 0, 0, 0))
    elif band is not None:
        got = (-3, band + (None, None))
    else:
        crop = (int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1)
        part = allowed[crop[0]:crop[1], crop[2]:crop[3]]
        if part.all():
            got = (-1, crop)
        else:                                                 # equal tiles are one (a mask not of i − j alone
            same = index.setdefault(("bytes", part.shape, part.tobytes()), len(tiles))   # repeats its diagonal's)
            if same == len(tiles):
                if (len(tiles) + 1) * P.cell * P.cell * 4 > MAX_TILE_BYTES:
                    return None
                tiles.append(part.astype(np.float32))
            got = (same, crop)
    index[key] = got
    return got


def _band(allowed: np.ndarray):
    """``(lo, hi)`` where ``allowed`` (rows × keys of a cell, something allowed) is the band ``lo ≤ c − r ≤ hi``
    with at least one edge binding in it (None for an edge that binds nowhere); else None."""
    r, c = np.indices(allowed.shape)
    diff = c - r
    lo, hi = int(diff[allowed].min()), int(diff[allowed].max())
    if not np.array_equal(allowed, (diff >= lo) & (diff <= hi)):
        return None
    lo = lo if lo > -(allowed.shape[0] - 1) else None
    hi = hi if hi < allowed.shape[1] - 1 else None
    return None if lo is None and hi is None else (lo, hi)
