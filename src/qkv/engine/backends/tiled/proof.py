"""The plan checker: proves from a plan alone that a call computes attention under its mask, without running it.

From a :class:`~qkv.backends.tiled.schedule.Plan` and the kernels' semantics (:mod:`qkv.backends.tiled.schedule`'s
module doc: rows of grouped query heads interleaved, a causal or band edge moving one key a position, a tile read
from its row origin, a Python-loop block applying its kind's mask exactly — a mask mod that says it depends on
``i − j`` alone evaluated as the engine does, at ``b = h = 0`` and shifted), it rebuilds for every head which
(query, key) scores are computed and kept, and requires:

* every allowed score kept exactly once, over all the call's tasks (split-K's parts included);
* no disallowed score kept;
* every piece within its task's rows and keys, and within its tile;
* in a task whose strategy writes its rows' state at their first block (``fresh``), no fresh piece over rows an
  earlier piece took; in the compiled loops' plans (made ahead as data) every row's first contribution fresh
  as well. (The Python loop's shift-free blocks decide ``fresh`` as they go and add a block whose rows are only
  partly new: onto zeros, as the state starts.)

"Allowed" is the call's meaning, evaluated densely per head: ``is_causal`` (top-left, key ≤ query), a boolean
``attn_mask`` (a float one: its finite entries), the block mask's ``mask_mod`` at every (query, key). A
violation raises :class:`PlanError` naming the head, the task, its strategy and the first scores that differ.
``QKV_CHECK_PLANS=1`` runs this on every tiled call before it computes anything.
"""
from __future__ import annotations

import numpy as np

from qkv.core.mods import call_mask_mod


class PlanError(AssertionError):
    """A plan that does not compute what the mask says (an engine bug, never the caller's)."""


def check(plan, meaning=None) -> None:
    """Prove ``plan`` (forward or backward) against its problem's mask; raises :class:`PlanError`. ``meaning``:
    ``head -> (L, S) bool`` to hold it to instead of :func:`allowed` of the plan's own problem (a caller's own
    reading of its arguments: then a plan made from the wrong problem cannot pass its own check)."""
    P = plan.problem
    if P is None:
        raise ValueError(f"plan: expected a plan of the tiled engine, got one of backend {plan.backend!r} (no tasks "
                         "to check)")
    groups: dict = {}                                         # the heads a task serves, together: their tasks
    for t in plan.tasks:
        if plan.direction == "forward":
            _check_fresh(t)
            heads = [t.head[:-1] + (t.head[-1] + h,) for h in range(t.group)] if t.head else [()]
        else:
            heads = [tuple(h) for h in t.heads]
        groups.setdefault(tuple(heads), []).append(t)
    done = set()
    for heads, tasks in groups.items():
        kept = np.zeros((len(heads), P.L, P.S), np.int16)
        for t in tasks:
            _add_task(P, plan.direction, t, heads, kept)
        for h, head in enumerate(heads):
            _compare(plan, head, kept[h], meaning)
            done.add(head)
    for head in np.ndindex(*P.lead):                          # heads no task serves: nothing may be allowed
        if head not in done:
            _compare(plan, head, np.zeros((P.L, P.S), np.int16), meaning)


def _compare(plan, head, kept: np.ndarray, meaning=None) -> None:
    want = allowed(plan.problem, head) if meaning is None else np.broadcast_to(meaning(head), kept.shape)
    if not np.array_equal(kept, want):
        raise PlanError(_difference(plan, head, kept, want))


def allowed(P, idx: tuple) -> np.ndarray:
    """(L, S) bool: the scores head ``idx`` may attend to — the call's meaning, evaluated densely."""
    q = np.arange(P.L, dtype=np.int64)[:, None]
    kv = np.arange(P.S, dtype=np.int64)[None, :]
    a = np.ones((P.L, P.S), bool)
    if P.is_causal:
        a &= kv <= q
    m = P.mask2d(idx)
    if m is not None:
        a &= m if m.dtype == np.bool_ else m > -np.inf
    if P.bm is not None:
        b, h = P.bh(idx)
        mb, mh = P.bm.index_arrays(b, h)
        a &= np.broadcast_to(call_mask_mod(P.bm.mask_mod, mb, mh, q, kv), a.shape)
    return a


def _add_task(P, direction: str, t, heads: list, kept: np.ndarray) -> None:
    """Add what task ``t`` keeps into ``kept`` (heads, L, S): the forward's ``group`` interleaved heads, the
    backward's query heads (a piece's ``head``)."""
    if direction == "forward":
        g, i0, i1 = t.group, t.rows[0], t.rows[1]
        for n, p in enumerate(t.pieces):
            # (any key: a split-K part owns the key blocks that start in its keys, cut into pieces after, so its
            # pieces may pass its end — the coverage over all parts is what proves it)
            _inside(t, n, p, 0, (i1 - i0) * g, 0, P.S, P.S)
            keep = _keep(P, t, p, heads[0], i0, g)
            for h in range(g):
                first = p.rows[0] + (h - p.rows[0]) % g       # this head's rows of the interleaved block
                if first < p.rows[1]:
                    mine = keep[first - p.rows[0]::g]
                    a = i0 + first // g
                    kept[h, a:a + len(mine), p.keys[0]:p.keys[1]] += mine
        return
    j0, j1 = t.keys
    for n, p in enumerate(t.pieces):
        _inside(t, n, p, 0, P.L, j0, j1, P.S)
        kept[p.head, p.rows[0]:p.rows[1], p.keys[0]:p.keys[1]] += _keep(P, t, p, heads[p.head], 0, 1)


def _inside(t, n: int, p, r_lo: int, r_hi: int, k_lo: int, k_hi: int, S: int) -> None:
    """A piece within rows ``r_lo … r_hi`` and keys ``k_lo … k_hi`` (and S)."""
    (r0, r1), (j0, j1) = p.rows, p.keys
    if not (r_lo <= r0 < r1 <= r_hi and max(0, k_lo) <= j0 < j1 <= min(k_hi, S)):
        raise PlanError(f"plan check: {_name(t)}: piece {n} rows {r0}…{r1} × keys {j0}…{j1} outside the task's "
                        f"rows {r_lo}…{r_hi} × keys {k_lo}…{min(k_hi, S)}")


def _keep(P, t, p, head: tuple, i0: int, g: int) -> np.ndarray:
    """(rows, keys) bool: what piece ``p`` keeps, by the kernels' semantics (rows of the task's block from ``i0``,
    ``g`` heads interleaved)."""
    (r0, r1), (j0, j1) = p.rows, p.keys
    r = np.arange(r1 - r0)[:, None]
    c = np.arange(j1 - j0)[None, :]
    off = r // g                                              # the kernels' edges move a position at a time
    keep = np.ones((r1 - r0, j1 - j0), bool)
    if p.upper is not None:
        keep &= c <= p.upper + off
    if p.lower is not None:
        keep &= c >= p.lower + off
    if p.tile is not None:
        keep &= _tile(t, p, off, c)
    if p.masks is not None:
        pos = i0 + (r0 + r) // g                              # absolute positions, absolute keys
        keep &= _masks(P, p.masks, head, pos, j0 + c, r, c)
    return keep


def _tile(t, p, off, c) -> np.ndarray:
    """The tile's 0/1 entries the kernel reads: row ``tile_row + r // g``, column ``c``."""
    tiles = t.tiles
    rows = p.tile_row + off
    if tiles is None or not 0 <= p.tile < tiles.shape[0] or p.tile_row < 0 or rows.max() >= tiles.shape[1] \
            or c.shape[1] > tiles.shape[2]:
        raise PlanError(f"plan check: {_name(t)}: a piece reads tile {p.tile} (row {p.tile_row} on) outside the "
                        f"tiles {None if tiles is None else tiles.shape}")
    return tiles[p.tile][rows, c] > 0


def _masks(P, masks, head, pos, keys, r, c) -> np.ndarray:
    """What a Python-loop block's kind applies, as the scorer applies it."""
    if masks == "causal":
        return keys <= pos
    if masks == "attn_mask":
        m = P.mask2d(head)[pos, keys]
        return m if m.dtype == np.bool_ else m > -np.inf
    kind, arg = masks
    if kind == "pattern":
        return arg[r, c]
    shape = np.broadcast_shapes(pos.shape, keys.shape)
    keep = np.ones(shape, bool)
    mods: dict = {}                                           # the mod over the block, per run's first key
    for o0, o1, c0, c1, v in arg:
        sel = (pos >= o0) & (pos < o1) & (keys >= c0) & (keys < c1)
        if not sel.any():
            continue
        if v < 0:
            keep &= ~sel
            continue
        ok = np.ones(shape, bool)
        if v & 1:
            shift = c0 if P.mask_traits.invariant else 0
            if shift not in mods:
                mods[shift] = _mod(P, head, pos, keys, shift)
            ok &= mods[shift]
        if v & 2:
            ok &= keys <= pos
        if v & 4:
            ok &= _masks(P, "attn_mask", head, pos, keys, r, c)
        keep &= ~sel | ok
    return keep


def _mod(P, head, pos, keys, c0: int) -> np.ndarray:
    """The mask mod as the scorer evaluates it: at ``b = h = 0``, shifted by the run's first key where it says it
    depends on ``i − j`` alone (its cached patterns), else at the head's (b, h) and the absolute indices."""
    mod = P.bm.mask_mod
    shape = np.broadcast_shapes(pos.shape, keys.shape)
    if P.mask_traits.invariant:
        zero = np.zeros((), np.int64)
        return np.broadcast_to(call_mask_mod(mod, zero, zero, pos - c0, keys - c0), shape)
    mb, mh = P.bm.index_arrays(*P.bh(head))
    return np.broadcast_to(call_mask_mod(mod, mb, mh, pos, keys), shape)


def _check_fresh(t) -> None:
    """Where a forward task's strategy writes a row's state at its first block: every row's first contribution
    fresh, no later one (a piece over rows some of which an earlier one took must be split)."""
    rows = (t.rows[1] - t.rows[0]) * t.group
    ahead = t.strategy.startswith("compiled loop")            # the plan's rows made ahead, fresh column and all
    seen = np.zeros(rows + 1, bool)
    for n, p in enumerate(t.pieces):
        r0, r1 = max(0, p.rows[0]), min(rows, p.rows[1])
        if p.fresh is not None and r0 < r1:
            took = seen[r0:r1]
            if p.fresh and took.any():
                raise PlanError(f"plan check: {_name(t)}: piece {n} (rows {p.rows[0]}…{p.rows[1]}, keys "
                                f"{p.keys[0]}…{p.keys[1]}) writes rows {r0 + int(np.argmax(took))}… that earlier "
                                "pieces accumulated into")
            if ahead and not p.fresh and not took.all():
                raise PlanError(f"plan check: {_name(t)}: piece {n} (rows {p.rows[0]}…{p.rows[1]}, keys "
                                f"{p.keys[0]}…{p.keys[1]}) adds to row {r0 + int(np.argmin(took))}, which no "
                                "earlier piece wrote")
        seen[r0:r1] = True


def _name(t) -> str:
    keys = "" if t.keys is None else f", keys {t.keys[0]}…{t.keys[1]}"
    return f"task head {t.head}, rows {t.rows[0]}…{t.rows[1]}{keys} ({t.strategy})"


def _difference(plan, head, kept: np.ndarray, want: np.ndarray, show: int = 4) -> str:
    """The first scores where what the plan keeps differs from the mask, and the tasks they belong to."""
    bad = np.argwhere(kept != want.astype(np.int32))
    lines = [f"plan check ({plan.direction}): head {head}: {len(bad)} scores differ from the mask"]
    for i, j in bad[:show]:
        owner = next((t for t in plan.tasks if _owns(plan, t, head, i, j)), None)
        lines.append(f"  score (query {i}, key {j}): kept {kept[i, j]}×, allowed {bool(want[i, j])}"
                     + ("" if owner is None else f" — {_name(owner)}"))
    return "\n".join(lines)


def _owns(plan, t, head, i: int, j: int) -> bool:
    if plan.direction == "backward":
        return tuple(head) in [tuple(h) for h in t.heads] and t.keys[0] <= j < t.keys[1]
    heads = [t.head[:-1] + (t.head[-1] + h,) for h in range(t.group)] if t.head else [()]
    keys = t.keys or (0, plan.S)
    return tuple(head) in heads and t.rows[0] <= i < t.rows[1] and keys[0] <= j < keys[1]


def untidy(plan) -> list:
    """What a compiled loop's plan does beyond what its mask needs — correct, but work or memory spent for
    nothing (the checker above proves correctness; this, economy). Per task of the compiled loops, each piece
    names an edge only where the edge masks something in it and a tile only where the tile masks something and
    keeps something; a task's tiles are distinct, float32 (the kernel's type) and each used. The tile loop's
    pieces are cut as :mod:`~qkv.backends.tiled.sparse` says (:func:`_cost`). Returns the findings as lines
    (empty: tidy). (A piece that keeps no score at all is not a finding: splitting a piece where its rows are
    half new leaves a row or two of nothing now and then — one small product.)"""
    P, out = plan.problem, []
    for t in plan.tasks:
        if not t.strategy.startswith("compiled loop") or plan.direction != "forward":
            continue
        for n, p in enumerate(t.pieces):
            out += [f"{_name(t)}: piece {n} {why}" for why in _piece_waste(P, t, p) + _cost(P, t, p)]
        if t.tiles is not None:
            out += [f"{_name(t)}: {why}" for why in _tile_waste(t)]
    return out


def _tile_waste(t) -> list:
    used = sorted({p.tile for p in t.pieces if p.tile is not None})
    found = [] if t.tiles.dtype == np.float32 else [f"tiles of {t.tiles.dtype}, not float32"]
    if used and used != list(range(len(t.tiles))):
        found.append(f"tiles {sorted(set(range(len(t.tiles))) - set(used))} are never used")
    seen: dict = {}
    for k in used:
        key = t.tiles[k].tobytes()
        if key in seen:
            found.append(f"tiles {seen[key]} and {k} are equal")
        seen[key] = k
    return found


def _cost(P, t, p) -> list:
    """The tile loop's cut (:func:`qkv.backends.tiled.sparse._cut`, ``_tall``): a piece without a tile that is
    not narrow is at most a strip's rows and about a ``band_rows_plain`` × ``band_keys_plain`` piece's scores (its
    lower edge's triangle: the strip and a 16-key rounding each side); a narrow full block (a sink's column) at
    most its tall piece's rows. (Where its keys start and end — multiples of 16 where a band's edge cuts them —
    is not a property of every plan: a cell's allowed keys are cropped first; tests pin it for windows.)"""
    if t.strategy != "compiled loop, tiles" or p.tile is not None:
        return []
    from qkv.engine.backends.tiled.sparse import NARROW

    lim, (j0, j1) = P.limits, p.keys
    rows = -(-(p.rows[1] - p.rows[0]) // t.group)                     # positions
    found = []
    area = max(1, lim.band_rows_plain) * max(1, lim.band_keys_plain)
    if p.upper is not None or p.lower is not None or j1 - j0 > NARROW:
        strip = lim.strip_rows_tiles
        most = max(16, area // rows // 16 * 16, strip + 2 * 16)
        if rows > strip or j1 - j0 > most:
            found.append(f"is {rows} rows × {j1 - j0} keys, over the strip's {strip} rows × {most} keys")
    else:
        tall = max(1, lim.band_rows_plain) * max(1, max(1, lim.band_keys_plain) // (j1 - j0))
        if rows > max(tall, lim.strip_rows_tiles):          # (or a strip's last piece of 16 keys)
            found.append(f"is {rows} rows of a narrow block, over its tall pieces' {tall}")
    return found


def _piece_waste(P, t, p) -> list:
    (r0, r1), (j0, j1) = p.rows, p.keys
    g = t.group
    r = np.arange(r1 - r0)[:, None] // g
    c = np.arange(j1 - j0)[None, :]
    found = []
    if p.upper is not None and not (c > p.upper + r).any():
        found.append(f"names an upper edge {p.upper} that masks nothing in it")
    if p.lower is not None and not (c < p.lower + r).any():
        found.append(f"names a lower edge {p.lower} that masks nothing in it")
    if p.tile is not None:
        tile = t.tiles[p.tile][p.tile_row + r[:, 0], :j1 - j0] > 0
        split = any(o is not p and o.tile == p.tile and o.keys == p.keys and (o.rows[0] == r1 or o.rows[1] == r0)
                    for o in t.pieces)        # a part of a piece split where its rows are half new: may be all 1s
        if (tile.all() and not split) or not tile.any():
            found.append(f"names tile {p.tile}, which {'masks nothing' if tile.all() else 'keeps nothing'} there")
    return found
