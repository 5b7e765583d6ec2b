"""Block-sparse tasks in the compiled loop (qkv.backends.tiled.sparse): a block mask's full cells as plain blocks,
its partial cells with 0/1 tiles, its empty cells skipped — every allowed score computed once, nothing else kept."""
import numpy as np
import pytest

import qkv
from qkv import mods
from qkv.backends import tiled
from qkv.backends.tiled import sparse

MASKS = {
    "sliding window": (mods.sliding_window(100), False),
    "documents": (mods.document_from_lengths([300, 200, 200]), False),
    "documents, causal": (mods.document_from_lengths([300, 200, 200]), True),
    "prefix LM": (mods.prefix_lm(150), False),
    "sinks or window": (mods.or_masks(mods.sinks(4), mods.sliding_window(64)), False),
    "a custom mask (not translation-invariant)": (qkv.mods.MaskMod(lambda b, h, q, kv: (q * 7 + kv * 3) % 5 != 0),
                                                  False),
}


@pytest.mark.parametrize("case", list(MASKS))
@pytest.mark.parametrize("rows", [(0, 700), (128, 512)])
def test_the_plan_covers_each_allowed_score_once_and_nothing_else(case, rows):
    mask_mod, causal = MASKS[case]
    L = S = 700
    bm = qkv.create_block_mask(mask_mod, None, None, L, S)
    z = np.zeros((1, 1, L, 8), np.float32)
    P = tiled.plan._Problem(z, z, z, None, causal, 1.0, False, block_mask=bm)
    i0, i1 = rows
    got = sparse.masked_plan(P, (0, 0), i0, i1, 1, 512)
    assert got is not None
    plan, tiles, room, _ = got
    allowed = np.broadcast_to(bm.dense((1, 1), L, S), (L, S)).copy()
    if causal:
        allowed &= np.tril(np.ones((L, S), bool))
    covered, kept = _coverage(plan, tiles, i1 - i0, S, room)
    want = allowed[i0:i1]
    assert covered.max() == 1                                      # no score computed twice
    np.testing.assert_array_equal(kept, want)                      # the allowed ones kept, the rest zeroed
    assert covered.sum() < 1.2 * want.sum() + 64 * 64 * 4 * (i1 - i0) / 64   # computed ≈ allowed + edge cells


def _coverage(plan, tiles, rows: int, S: int, room: int):
    """How often the plan computes each score, and what it keeps of it: 1 where the kernel's edges (``d``,
    ``lo``: key ``j0 + c`` for row ``r0 + r`` where ``lo ≤ c − r ≤ d``) and the tile allow it."""
    covered = np.zeros((rows, S), np.int64)
    kept = np.zeros((rows, S))
    for r0, r1, j0, j1, d, fresh, t, lo, t0 in plan:
        assert (r1 - r0) * (j1 - j0) <= room
        covered[r0:r1, j0:j1] += 1
        r, c = np.indices((r1 - r0, j1 - j0))
        keep = np.ones((r1 - r0, j1 - j0))
        if d != qkv.kernels.NO_MASK:
            keep *= c <= d + r
        if lo != qkv.kernels.NO_LO:
            keep *= c >= lo + r
        if t >= 0:
            keep *= tiles[t, t0:t0 + r1 - r0, :j1 - j0]
        kept[r0:r1, j0:j1] += keep
    return covered, kept


def test_an_attn_mask_or_too_many_tiles_keep_the_other_strategies(monkeypatch):
    L = 256
    z = np.zeros((1, 1, L, 8), np.float32)
    bm = qkv.create_block_mask(mods.sliding_window(40), None, None, L, L)
    P = tiled.plan._Problem(z, z, z, np.ones((L, L), bool), False, 1.0, False, block_mask=bm)
    assert sparse.masked_plan(P, (0, 0), 0, L, 1, 512) is None
    monkeypatch.setattr(sparse, "MAX_TILE_BYTES", 1)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    assert sparse.masked_plan(P, (0, 0), 0, L, 1, 512) is not None      # a window's edges need no tiles
    bm = qkv.create_block_mask(MASKS["a custom mask (not translation-invariant)"][0], None, None, L, L)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    assert sparse.masked_plan(P, (0, 0), 0, L, 1, 512) is None


@pytest.mark.parametrize("case", list(MASKS))
def test_tiled_tasks_equal_the_float64_reference(case):
    pytest.importorskip("numba")
    mask_mod, causal = MASKS[case]
    rng = np.random.default_rng(5)
    L = 700
    q, k, v = (rng.standard_normal((2, 3, L, 32), dtype=np.float32) for _ in range(3))
    bm = qkv.create_block_mask(mask_mod, None, None, L, L)
    with qkv.paths.counting() as seen:
        out, _, lse = tiled.forward(q, k, v, scale=32 ** -0.5, block_mask=bm, is_causal=causal, return_lse=True)
    assert seen["forward.tile_loop"] > 0
    f = np.float64
    ref, _, rl = qkv.backends.get("reference").forward(q.astype(f), k.astype(f), v.astype(f), scale=32 ** -0.5,
                                                       block_mask=bm, is_causal=causal, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lse[fin], rl[fin], rtol=2e-6, atol=2e-6)
    assert np.array_equal(np.isfinite(lse), fin)                   # rows with nothing allowed: −inf, output 0


def test_a_sinks_column_and_a_windows_strips_take_few_pieces():
    """A sink's column of keys is a few tall pieces, not one per cell (each a pair of tiny products); a sliding
    window's row of cells is one run of keys a strip (its two edges masked in the loop, no tiles), in two
    pieces: its lower edge's triangle and the rest; the plan still covers each allowed score once."""
    L = S = 2048
    bm = qkv.create_block_mask(mods.or_masks(mods.sinks(4), mods.sliding_window(256)), None, None, L, S)
    z = np.zeros((1, 1, L, 8), np.float32)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    plan, tiles, room, strips = sparse.masked_plan(P, (0, 0), 0, L, 1, 512)
    sink = plan[(plan[:, 2] == 0) & (plan[:, 3] == 4)]
    assert 1 <= len(sink) <= 4 and (sink[:, 1] - sink[:, 0]).max() > 2 * 64     # was one a 32-row cell: 56
    covered, kept = _coverage(plan, tiles, L, S, room)
    assert covered.max() == 1
    np.testing.assert_array_equal(kept, np.broadcast_to(bm.dense((1, 1), L, S), (L, S)))
    # a window's task off the first rows: two pieces a strip, no tiles, 1/32 of the scores computed for nothing
    L = S = 8192
    bm = qkv.create_block_mask(mods.sliding_window(512), None, None, L, S)
    z = np.zeros((1, 1, L, 8), np.float32)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    strip = tiled.STRIP_ROWS_TILES
    plan, tiles, room, strips = sparse.masked_plan(P, (0, 0), 4096, 8192, 1, 512)
    assert strips and len(plan) == 2 * 4096 // strip and (plan[:, 6] < 0).all()
    assert ((plan[:, 1] - plan[:, 0]) * (plan[:, 3] - plan[:, 2])).sum() == 4096 * (512 + strip)
    with tiled.limits(strip_rows_tiles=32):                        # (a call's limits: read by its problem)
        P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
        plan32 = sparse.masked_plan(P, (0, 0), 4096, 8192, 1, 512)[0]
    assert len(plan32) == 3 * 4096 // 32            # its triangle and two of 256 keys (the limit is in the key)


def test_a_band_cell_is_recognised_and_only_a_band():
    """A cell whose allowed scores are ``lo ≤ j − i ≤ hi`` is a band (its edges the loop's ``lo`` and ``d``);
    a block of documents, a strided pattern or a rectangle that is not one is not."""
    i, j = np.indices((8, 8))
    assert sparse._band((j - i >= -3) & (j - i <= 2)) == (-3, 2)
    assert sparse._band(j <= i) == (None, 0)                       # a causal diagonal: its upper edge alone
    assert sparse._band(j - i >= 5) == (5, None)
    assert sparse._band((i < 4) == (j < 4)) is None                # two documents meet
    assert sparse._band(j < 3) is None                             # a sink's keys
    assert sparse._band(np.ones((8, 8), bool)) is None             # nothing binds: a full cell


@pytest.mark.parametrize("L, block_size, window", [(1024, 8, 20), (1024, 24, 30), (700, 8, 5), (2048, 40, 100)])
def test_windows_whose_cells_start_between_multiples_of_16_are_right(L, block_size, window):
    """A band's strip rounded its first and last keys to multiples of 16 past the run's own keys: with BLOCK_SIZE 8,
    24 or 40 the keys before a run's first cell were kept twice (errors 0.4–0.85, found by the plan checker)."""
    pytest.importorskip("numba")
    r = np.random.default_rng(L + block_size)
    q, k, v = (r.standard_normal((1, 2, L, 64)).astype(np.float32) for _ in range(3))
    bm = qkv.create_block_mask(mods.sliding_window(window), None, None, L, L, BLOCK_SIZE=block_size)
    p = qkv.plan(q, k, v, block_mask=bm)
    assert "compiled loop, tiles" in p.strategies()
    qkv.check_plan(p)
    out = qkv.flex_attention(q, k, v, None, bm)
    ref = qkv.flex_attention(*(a.astype(np.float64) for a in (q, k, v)), None, bm, backend="reference")
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
