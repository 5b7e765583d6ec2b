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
    plan, tiles, room = got
    allowed = np.broadcast_to(bm.dense((1, 1), L, S), (L, S)).copy()
    if causal:
        allowed &= np.tril(np.ones((L, S), bool))
    covered = np.zeros((i1 - i0, S), np.int64)
    kept = np.zeros((i1 - i0, S))
    for r0, r1, j0, j1, d, fresh, t in plan:
        assert d == qkv.kernels.NO_MASK and (r1 - r0) * (j1 - j0) <= room
        covered[r0:r1, j0:j1] += 1
        kept[r0:r1, j0:j1] += 1.0 if t < 0 else tiles[t, :r1 - r0, :j1 - j0]
    want = allowed[i0:i1]
    assert covered.max() == 1                                      # no score computed twice
    np.testing.assert_array_equal(kept, want)                      # the allowed ones kept, the rest zeroed
    assert covered.sum() < 1.2 * want.sum() + 64 * 64 * 4 * (i1 - i0) / 64   # computed ≈ allowed + edge cells


def test_an_attn_mask_or_too_many_tiles_keep_the_other_strategies(monkeypatch):
    L = 256
    z = np.zeros((1, 1, L, 8), np.float32)
    bm = qkv.create_block_mask(mods.sliding_window(40), None, None, L, L)
    P = tiled.plan._Problem(z, z, z, np.ones((L, L), bool), False, 1.0, False, block_mask=bm)
    assert sparse.masked_plan(P, (0, 0), 0, L, 1, 512) is None
    monkeypatch.setattr(sparse, "MAX_TILE_BYTES", 1)
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


def test_a_sinks_column_and_the_staircase_take_few_pieces():
    """A sink's column of keys is a few tall pieces, not one per cell (each a pair of tiny products), and a band's
    touching full pieces of the same rows are joined; the plan still covers each allowed score once."""
    L = S = 2048
    bm = qkv.create_block_mask(mods.or_masks(mods.sinks(4), mods.sliding_window(256)), None, None, L, S)
    z = np.zeros((1, 1, L, 8), np.float32)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    plan = sparse.masked_plan(P, (0, 0), 0, L, 1, 512)[0]
    sink = plan[(plan[:, 2] == 0) & (plan[:, 3] == 4)]
    assert 1 <= len(sink) <= 4 and (sink[:, 1] - sink[:, 0]).max() > 2 * 64     # was one a 32-row cell: 56
    cover = np.zeros((L, S), np.int64)
    for r0, r1, j0, j1, *_ in plan:
        cover[r0:r1, j0:j1] += 1
    assert cover.max() == 1
    # a window's task off the first rows: no two full pieces of the same rows touch (715 pieces unjoined, 705)
    L = S = 8192
    bm = qkv.create_block_mask(mods.sliding_window(512), None, None, L, S)
    z = np.zeros((1, 1, L, 8), np.float32)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    plan = sparse.masked_plan(P, (0, 0), 4096, 8192, 1, 512)[0]
    rows = {}
    for r0, r1, j0, j1, *_ in plan[plan[:, 6] < 0]:
        for c0, c1 in rows.get((r0, r1), []):
            assert j1 != c0 and j0 != c1 or (j1 - j0) + (c1 - c0) > tiled.BAND_KEYS_PLAIN
        rows.setdefault((r0, r1), []).append((j0, j1))
