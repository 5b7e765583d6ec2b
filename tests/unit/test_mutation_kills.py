"""Tests written to kill the mutants that the fast tier let live (issue 39, ``make mutation``; docs/mutation.md).

Each test names what it pins down: split-K's key parts (their count, order and balance), the dtypes and the
``lse`` the split-K forward returns, and the choice of split-K itself (threads, dropout, weights). The mutants
left alive after these are equivalent: docs/mutation.md lists them with why.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import qkv
from qkv import mods as M
from qkv.backends.tiled import backend, limits, split
from qkv.backends.tiled.thresholds import current_limits

#: Limits under which a few query rows against a few dozen keys take split-K.
SPLIT_K = dict(kernel_min=0, serial_below_flops=0, split_k_min_blocks=1, split_k_min_part_keys=4)


def _decode(S: int = 100, E: int = 4, dtype=np.float32, seed: int = 0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((1, 1, 1, E)).astype(dtype)
    k, v = (r.standard_normal((1, 1, S, E)).astype(dtype) for _ in range(2))
    return q, k, v


def _reference(q, k, v, scale=0.5):
    s = (q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)) * scale
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    return np.exp(s - lse[..., None]) @ v.astype(np.float64), lse


# ============================================================================================ split-K's bounds
@pytest.mark.parametrize("S, bk, splits", [(100, 8, 4), (100, 8, 2), (25, 8, 2), (64, 16, 4), (9, 8, 2),
                                           (1000, 64, 3), (17, 4, 5)])
def test_split_k_bounds_are_splits_plus_one_increasing_block_edges_that_share_the_blocks_evenly(S, bk, splits):
    bounds = split.key_bounds(SimpleNamespace(S=S), splits, bk)
    assert len(bounds) == splits + 1 and bounds[0] == 0
    assert bounds[-1] >= S and bounds[-2] < S                   # the last part ends at (or past) the keys' end
    inner = bounds[:-1]
    assert all(b % bk == 0 for b in inner), bounds              # parts start at key-block boundaries
    blocks = [(-(-min(b1, S) // bk)) - b0 // bk for b0, b1 in zip(bounds, bounds[1:])]
    assert all(n >= 1 for n in blocks), bounds                  # no part is empty
    assert max(blocks) - min(blocks) <= 1, bounds               # …and they share the blocks evenly


def test_split_k_plan_parts_partition_the_keys_in_order():
    """The plan of a decode-like call under split-K: per head its parts' key ranges follow each other from 0 to S,
    none empty, the count the plan says."""
    q, k, v = _decode(S=100)
    with limits(**SPLIT_K, block_k=8):
        p = qkv.plan(q, k, v, backend="tiled", threads=4)
    assert p.split_k > 1
    ranges = sorted({t.keys for t in p.tasks})
    assert len(ranges) == p.split_k
    assert ranges[0][0] == 0 and ranges[-1][1] >= 100
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
    assert all(k0 < min(k1, 100) for k0, k1 in ranges), ranges


# ======================================================================================== split-K's results
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("return_lse", [False, True])
def test_split_k_returns_the_input_dtype_and_lse_only_when_asked(dtype, return_lse):
    """As the forward's doc says: ``output`` in the input dtype, ``lse`` in the compute dtype (float32 for
    float16/32 inputs) and None unless asked for — under split-K as on the other paths."""
    q, k, v = _decode(S=100, dtype=dtype)
    with limits(**SPLIT_K, block_k=8):
        assert qkv.plan(q, k, v, backend="tiled", threads=4, scale=0.5).split_k > 1
        out, weights, lse = backend.forward(q, k, v, scale=0.5, threads=4, return_lse=return_lse)
    assert out.dtype == dtype and weights is None
    if return_lse:
        assert lse is not None and lse.dtype == np.float32
        ref_out, ref_lse = _reference(q, k, v)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-3 if dtype == np.float16 else 1e-5)
        np.testing.assert_allclose(out, ref_out, atol=2e-3 if dtype == np.float16 else 1e-5)
    else:
        assert lse is None


# ============================================================================= when split-K is taken at all
def _P(L=1, S=100, E=4, Ev=4, **lim):
    with limits(**{**SPLIT_K, **lim}):
        return SimpleNamespace(L=L, S=S, E=E, Ev=Ev, limits=current_limits())


@pytest.mark.parametrize("threads, n_tasks, dropout_p, weights, want", [
    (1, 1, 0.0, False, 1),          # one worker: nothing to share
    (4, 4, 0.0, False, 1),          # as many tasks as workers: every worker has one already
    (4, 5, 0.0, False, 1),
    (4, 1, 0.1, False, 1),          # dropout: its mask is drawn per task
    (4, 1, 0.0, True, 1),           # weights: a second pass over all keys
    (4, 1, 0.0, False, 4),
    (2, 1, 0.0, False, 2),          # two workers, one task: the common decode
    (4, 2, 0.0, False, 2),          # ceil(threads / tasks)
    (3, 2, 0.0, False, 2),
])
def test_key_splits_follows_its_rule(threads, n_tasks, dropout_p, weights, want):
    assert split._key_splits(_P(), n_tasks, threads, 1, 8, dropout_p, weights) == want


def test_key_splits_is_bounded_by_blocks_part_keys_and_the_work_a_part_pays_for():
    assert split._key_splits(_P(split_k_min_blocks=5), 1, 8, 1, 8, 0.0, False) == 13 // 5     # 13 key blocks
    got = split._key_splits(_P(split_k_min_blocks=1), 1, 16, 1, 8, 0.0, False)
    assert got == 13 and isinstance(got, int)                   # the last, partial block counts: one part each
    assert split._key_splits(_P(split_k_min_part_keys=30), 1, 8, 1, 8, 0.0, False) == 100 // 30
    # each part must still cost 2·rows·keys·(E + Ev) ≥ serial_below_flops: 2·1·(100/s)·8 = 1600/s flops
    assert split._key_splits(_P(serial_below_flops=400), 1, 8, 1, 8, 0.0, False) == 4
    assert split._key_splits(_P(serial_below_flops=401), 1, 8, 1, 8, 0.0, False) == 3
    assert split._key_splits(_P(serial_below_flops=1601), 1, 8, 1, 8, 0.0, False) == 1
    assert split._key_splits(_P(L=3, serial_below_flops=1201), 1, 8, 2, 8, 0.0, False) == 2   # min(bq, L) rows


# ========================================================================== the tile loop's plans: their cost
def _tile_problem(mask_mod, L, S=None, block_size=128, causal=False, E=8):
    from qkv.backends.tiled import plan as tplan
    S = S or L
    bm = qkv.create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=block_size)
    z, zk = np.zeros((1, 1, L, E), np.float32), np.zeros((1, 1, S, E), np.float32)
    return tplan._Problem(z, zk, zk, None, causal, 1.0, False, block_mask=bm)


WINDOW_LIMITS = [dict(), dict(band_rows_plain=4, band_keys_plain=16, strip_rows_tiles=4),
                 dict(band_rows_plain=16, band_keys_plain=48, strip_rows_tiles=2), dict(strip_rows_tiles=64)]


@pytest.mark.parametrize("window", [13, 100, 257, 511])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("rows", [(0, 1024), (300, 1000)])
@pytest.mark.parametrize("moved", range(len(WINDOW_LIMITS)))
def test_a_windows_strips_are_cut_at_multiples_of_16_as_the_limits_say(window, block_size, rows, moved):
    """A sliding window's pieces (its cells are bands: no tiles) start and end their keys at multiples of 16 —
    the strip's lower edge rounded down, its upper edge up — or at the keys' end; each keeps something; each is
    at most a strip's rows and ``band_rows_plain × band_keys_plain`` scores; and a strip's lower edge is one
    piece of its run, its triangle: from the first row's first key (rounded down) to the last row's first key,
    rounded up to 16 — the first key every row of the strip takes — or to the run's end before it."""
    from qkv.backends.tiled import sparse
    from qkv.kernels import NO_LO, NO_MASK
    L = 1024
    with limits(**WINDOW_LIMITS[moved]):
        P = _tile_problem(M.sliding_window(window), L, block_size=block_size)
    plan, tiles, room, strips = sparse.masked_plan(P, (0, 0), *rows, 1, 512)
    lim, i0 = P.limits, rows[0]
    area = lim.band_rows_plain * lim.band_keys_plain
    allowed = np.broadcast_to(P.bm.dense((1, 1), L, L), (L, L))
    assert (plan[:, 6] < 0).all() and strips
    triangles: dict = {}
    for r0, r1, j0, j1, d, fresh, t, lo, t0 in plan:
        n, a = r1 - r0, i0 + r0
        assert j0 % 16 == 0 and (j1 % 16 == 0 or j1 == L), (r0, r1, j0, j1)
        assert allowed[a:a + n, j0:j1].any(), (r0, r1, j0, j1)
        narrow = j1 - j0 <= sparse.NARROW and d == NO_MASK and lo == NO_LO      # a full column: tall pieces
        assert n <= (lim.band_rows_plain * max(1, lim.band_keys_plain // (j1 - j0)) if narrow
                     else lim.strip_rows_tiles), (r0, r1, j0, j1)
        assert j1 - j0 <= max(16, area // n // 16 * 16, n + 32), (r0, r1, j0, j1)
        if lo != NO_LO:                                          # a run's lower edge: its triangle
            first = int(np.argmax(allowed[a + n - 1]))          # the last row's first key
            triangles.setdefault((r0, r1), []).append((j1, -(-first // 16) * 16))
    assert triangles
    kept = np.zeros((rows[1] - rows[0], L), np.int64)              # what the loop keeps: the mask, exactly once
    for r0, r1, j0, j1, d, fresh, t, lo, t0 in plan:
        r, c = np.indices((r1 - r0, j1 - j0))
        keep = np.ones((r1 - r0, j1 - j0), np.int64)
        if d != NO_MASK:
            keep &= c <= d + r
        if lo != NO_LO:
            keep &= c >= lo + r
        kept[r0:r1, j0:j1] += keep
    np.testing.assert_array_equal(kept, allowed[rows[0]:rows[1]])
    for strip, ends in triangles.items():                       # at its rounded end, or its run's end before it
        assert all(j1 == want or (j1 < want and (j1 % P.cell == 0 or j1 == L)) for j1, want in ends), (strip, ends)


def test_the_tile_loops_plan_contract_room_strips_tiles_and_its_cache():
    """``masked_plan``'s four results as the compiled loop reads them: ``room`` exactly the largest piece's scores
    (the scratch it sizes), ``strips`` whether any piece has an edge, ``tiles`` float32 (the kernel's type), one
    per distinct tile, every one used; and the plan made once per block mask and task (the same object the
    second time), a different one for different rows, head grouping or width."""
    from qkv.backends.tiled import sparse
    from qkv.kernels import NO_LO, NO_MASK
    P = _tile_problem(M.and_masks(M.causal(), M.document(np.arange(1000) // 230)), 1000, block_size=64)
    got = sparse.masked_plan(P, (0, 0), 0, 1000, 1, 512)
    plan, tiles, room, strips = got
    assert room == ((plan[:, 1] - plan[:, 0]) * (plan[:, 3] - plan[:, 2])).max()
    assert strips == bool(((plan[:, 4] != NO_MASK) | (plan[:, 7] != NO_LO)).any()) and strips
    assert tiles.dtype == np.float32 and tiles.shape[1:] == (P.cell, P.cell)
    used = sorted(set(plan[:, 6][plan[:, 6] >= 0].tolist()))
    assert used == list(range(len(tiles))) and len({t.tobytes() for t in tiles}) == len(tiles)
    assert sparse.masked_plan(P, (0, 0), 0, 1000, 1, 512) is got            # kept with the block mask
    for args in [(100, 1000, 1, 512), (0, 900, 1, 512), (0, 1000, 2, 512), (0, 1000, 1, 128)]:
        other = sparse.masked_plan(P, (0, 0), *args)
        fresh = sparse._build(P, (0, 0), *args)
        assert other is not got
        for a, b in zip(other[:2], fresh[:2]):
            np.testing.assert_array_equal(a, b)
    # a window: no tiles at all (a zero tile as the kernel's placeholder), no strips without edges
    P = _tile_problem(M.sliding_window(300), 1024, block_size=128)
    plan, tiles, room, strips = sparse.masked_plan(P, (0, 0), 0, 1024, 1, 512)
    assert (plan[:, 6] < 0).all() and tiles.shape == (1, P.cell, P.cell) and not tiles.any()
    P = _tile_problem(M.document(np.arange(1024) // 256), 1024, block_size=128)
    plan, tiles, room, strips = sparse.masked_plan(P, (0, 0), 0, 1024, 1, 512)
    assert not strips and (plan[:, 6] < 0).all()                            # squares of whole cells


def test_untidy_finds_a_wasteful_plan():
    """The economy check is not vacuous: an unused tile, a float64 tile stack, a piece wider than the strip's
    limits and a narrow block's piece taller than its tall pieces are each named."""
    import dataclasses
    from qkv.backends.tiled import proof
    pytest.importorskip("numba")
    r = np.random.default_rng(0)
    q, k, v = ((r.standard_normal((1, 1, 600, 8)) * 0.05).astype(np.float32) for _ in range(3))
    bm = qkv.create_block_mask(M.and_masks(M.causal(), M.document(np.arange(600) // 150)), None, None, 600, 600)
    p = qkv.plan(q, k, v, block_mask=bm, backend="tiled")
    t = next(t for t in p.tasks if t.strategy == "compiled loop, tiles")
    assert not proof.untidy(p)

    def with_task(**kw):
        return dataclasses.replace(p, tasks=(dataclasses.replace(t, **kw),))
    extra = np.concatenate([t.tiles, np.zeros_like(t.tiles[:1])])
    assert any("never used" in x for x in proof.untidy(with_task(tiles=extra)))
    assert any("not float32" in x for x in proof.untidy(with_task(tiles=t.tiles.astype(np.float64))))
    wide = dataclasses.replace(t.pieces[0], rows=(0, 64), keys=(0, 600), upper=None, lower=None, tile=None)
    assert any("over the strip" in x for x in proof.untidy(with_task(pieces=(wide,))))
    tall = dataclasses.replace(t.pieces[0], rows=(0, 600), keys=(0, 16), upper=None, lower=None, tile=None)
    assert any("narrow block" in x for x in proof.untidy(with_task(pieces=(tall,))))


def _count_mask_calls(monkeypatch):
    from qkv.backends.tiled import sparse
    calls = []
    real = sparse.call_mask_mod

    def counted(mod, b, h, q, kv):
        calls.append((int(np.min(q)), int(np.min(kv))))
        return real(mod, b, h, q, kv)
    monkeypatch.setattr(sparse, "call_mask_mod", counted)
    return calls


def test_a_tile_is_evaluated_once_per_offset_of_a_translation_invariant_mask(monkeypatch):
    """A mask of ``i − j`` alone (a window with BLOCK_SIZE not a multiple of 16: partial cells that are not bands
    everywhere) evaluates its mask mod once per distinct (offset, shape) of its partial cells; a mask that is not
    invariant, once per partial cell; a cell that is partial only by the causal mask (``is_causal`` over whole
    documents) never calls the mask mod."""
    from qkv.backends.tiled import sparse
    L = 1024
    for mod, invariant in [(M.or_masks(M.sinks(3), M.sliding_window(40)), False),
                           (M.and_masks(M.sliding_window(200), M.MaskMod(lambda b, h, q, kv: (q - kv) % 3 != 1,
                                                                      traits=M.MaskTraits(invariant=True))), True)]:
        calls = _count_mask_calls(monkeypatch)
        P = _tile_problem(mod, L, block_size=64)
        got = sparse._build(P, (0, 0), 0, L, 1, 512)
        assert got is not None
        G = P.grid((0, 0))[0]
        partial = int((G > 0).sum())
        if invariant:
            offsets = {(r - c) for r, c in zip(*np.nonzero(G > 0))}
            assert len(calls) <= len(offsets) + 2 < partial, (len(calls), len(offsets), partial)
        else:
            assert len(calls) == partial, (len(calls), partial)
    calls = _count_mask_calls(monkeypatch)
    P = _tile_problem(M.document(np.arange(L) // 256), L, block_size=64, causal=True)
    assert sparse._build(P, (0, 0), 0, L, 1, 512) is not None
    assert calls == []                                        # whole documents: only the diagonal is partial


def test_a_partial_cell_with_nothing_allowed_is_skipped():
    """A cell partial by both the mask mod and ``is_causal`` whose two allow nothing together (keys after the
    query, and the causal mask) keeps no piece at all."""
    from qkv.backends.tiled import proof
    pytest.importorskip("numba")
    r = np.random.default_rng(1)
    L = 600
    q, k, v = ((r.standard_normal((1, 1, L, 8)) * 0.05).astype(np.float32) for _ in range(3))
    later = M.MaskMod(lambda b, h, qi, kv: (kv > qi) | (kv < qi - 100))
    bm = qkv.create_block_mask(later, None, None, L, L, BLOCK_SIZE=64)
    p = qkv.plan(q, k, v, block_mask=bm, is_causal=True, backend="tiled")
    assert any(t.strategy == "compiled loop, tiles" for t in p.tasks)
    proof.check(p)
    assert not proof.untidy(p)


def test_tiles_over_the_byte_limit_keep_the_other_strategies(monkeypatch):
    """``MAX_TILE_BYTES`` is the tiles' float32 bytes: a plan whose tiles take exactly that many is made, one byte
    less keeps the other strategies."""
    from qkv.backends.tiled import sparse
    mod = qkv.mods.MaskMod(lambda b, h, q, kv: (q * 7 + kv * 3) % 5 != 0)
    P = _tile_problem(mod, 256, block_size=32)
    plan, tiles, room, strips = sparse._build(P, (0, 0), 0, 256, 1, 512)
    need = len(tiles) * P.cell * P.cell * 4
    monkeypatch.setattr(sparse, "MAX_TILE_BYTES", need)
    assert sparse._build(P, (0, 0), 0, 256, 1, 512) is not None
    monkeypatch.setattr(sparse, "MAX_TILE_BYTES", need - 1)
    assert sparse._build(P, (0, 0), 0, 256, 1, 512) is None


@pytest.mark.parametrize("offset", [-1, 14, 30, 62])
def test_a_band_whose_edge_binds_at_a_cells_last_key_is_kept_to_it(offset):
    """``kv ≤ q + offset``: a band's upper edge in each cell it crosses; where it binds at a cell's last key but
    one or its first (``offset`` 30 with the 32-key cells of the engine's grid, −1 strictly causal) the plan still
    keeps exactly what the mask allows, with edges, never a tile — and a strictly causal diagonal joins the full cells to its left into one run: its strips are
    pieces of the full step, the last to the edge."""
    from qkv.backends.tiled import proof, sparse
    pytest.importorskip("numba")
    L = 700
    r = np.random.default_rng(2)
    q, k, v = ((r.standard_normal((1, 1, L, 8)) * 0.05).astype(np.float32) for _ in range(3))
    mod = M.MaskMod(lambda b, h, qi, kv: kv <= qi + offset, traits=M.MaskTraits(invariant=True))
    for bs in (16, 32, 64):
        bm = qkv.create_block_mask(mod, None, None, L, L, BLOCK_SIZE=bs)
        p = qkv.plan(q, k, v, block_mask=bm, backend="tiled")
        assert any(t.strategy == "compiled loop, tiles" for t in p.tasks)
        assert all(pc.tile is None for t in p.tasks for pc in t.pieces)     # bands: edges, never a tile
        proof.check(p)
        assert not proof.untidy(p)
    if offset == -1:
        P = _tile_problem(mod, 2048, block_size=64)
        plan = sparse.masked_plan(P, (0, 0), 0, 2048, 1, 512)[0]
        lim = P.limits
        by_strip: dict = {}
        for r0, r1, j0, j1, *_ in plan:
            by_strip.setdefault((r0, r1), []).append((j0, j1))
        for (r0, r1), keys in by_strip.items():
            step = max(16, lim.band_rows_plain * lim.band_keys_plain // (r1 - r0) // 16 * 16)
            keys.sort()
            assert keys[0][0] == 0 and all(a[1] == b[0] for a, b in zip(keys, keys[1:])), keys
            assert all(j1 - j0 == step for j0, j1 in keys[:-1]), ((r0, r1), keys, step)


@pytest.mark.parametrize("window", [13, 40, 200])
@pytest.mark.parametrize("block_size", [16, 64])
def test_narrow_columns_are_few_tall_pieces_and_a_windows_split_parts_keep_their_edges(window, block_size):
    """Two columns of global keys (4 keys each, for the queries from 1000 on, which start inside a strip)
    beside a sliding window: each column is joined down the rows into tall pieces of ``band_rows_plain · (band_keys_plain // 4)`` rows — as few as that allows —
    and the window's pieces, split where the columns' rows came first, keep their edges where they bind and
    nowhere else (the plan proven, and tidy)."""
    from qkv.backends.tiled import proof, sparse
    pytest.importorskip("numba")
    L = 1536
    cols = M.MaskMod(lambda b, h, q, kv: ((kv < 4) | ((kv >= 300) & (kv < 304))) & (q >= 1000))
    mod = M.or_masks(cols, M.sliding_window(window))
    P = _tile_problem(mod, L, block_size=block_size)
    plan = sparse.masked_plan(P, (0, 0), 0, L, 1, 512)[0]
    lim = P.limits
    rh = lim.band_rows_plain * max(1, lim.band_keys_plain // 4)
    for k0, rows in ((0, L - 1000), (300, L - 1000)):
        col = plan[(plan[:, 2] == k0) & (plan[:, 3] == k0 + 4)]
        assert 1 <= len(col) <= -(-rows // rh) + 1, (k0, len(col), rh)
    r = np.random.default_rng(4)
    q, k, v = ((r.standard_normal((1, 1, L, 8)) * 0.05).astype(np.float32) for _ in range(3))
    bm = qkv.create_block_mask(mod, None, None, L, L, BLOCK_SIZE=block_size)
    p = qkv.plan(q, k, v, block_mask=bm, backend="tiled")
    proof.check(p)
    assert not proof.untidy(p)
