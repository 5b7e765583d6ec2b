"""The plan checker on random problems (issue 39): every plan the tiled engine makes — forward and backward, every
strategy, split-K, row shares, grouped heads, tiles and band edges — proven against its mask without running
attention (:mod:`qkv.backends.tiled.proof`).

Problems: packed documents with any number and placement of boundaries (per batch row too), windows of every
width, prefix LM, sinks, their ``and``/``or`` combinations, random custom masks (per head too), ``is_causal``
(top-left) and the bottom-right causal mask as an ``attn_mask``, boolean and float ``attn_mask`` s, L ≠ S,
grouped-query heads, BLOCK_SIZE 4…128, and the engine's limits moved so that small problems are cut as large
ones are (tiles, strips, bands, quadrants of the diagonal, split-K, row shares). ``PLAN_EXAMPLES`` per test, five
tests: 10,000+ problems a run, derandomized (CI reproduces). Reverting the tile-origin fix (commit 0b6fd78) makes
the forward test fail: hypothesis shrinks it to two documents whose boundary falls inside a cell.
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv
from qkv import mods as M
from qkv.backends.tiled import limits, proof

#: Problems per sweep (10,000 in all); ``QKV_PLAN_EXAMPLES=N`` runs N per sweep instead.
_ENV = int(os.environ.get("QKV_PLAN_EXAMPLES", "0") or 0)


def sweep(n: int):
    return settings(max_examples=_ENV or n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

pytestmark = pytest.mark.filterwarnings("ignore")
TILE_LOOP: list = []                                          # whether each tile-loop problem's plan took it


@st.composite
def documents(draw, L: int, B: int):
    """Document ids per position (one row, or one per batch row): 1 to 12 boundaries anywhere."""
    def one():
        cuts = draw(st.lists(st.integers(1, max(1, L - 1)), min_size=0, max_size=12, unique=True))
        return np.searchsorted(np.sort(cuts), np.arange(L), side="right")
    if B > 1 and draw(st.booleans()):
        return M.document(np.stack([one() for _ in range(B)]))
    return M.document(one())


@st.composite
def mask_mods(draw, L: int, S: int, B: int, H: int, depth: int = 0):
    """A mask mod of any family, combinations included."""
    options = ["documents", "window", "prefix", "sinks", "causal", "custom", "custom per head"]
    if depth < 1:
        options += ["and", "or"]
    kind = draw(st.sampled_from(options))
    if kind == "documents" and L == S:
        return draw(documents(L, B))
    if kind == "window":
        return M.sliding_window(draw(st.integers(1, S + 2)))
    if kind == "prefix":
        return M.prefix_lm(draw(st.integers(0, S)))
    if kind == "sinks":
        return M.sinks(draw(st.integers(1, max(1, S // 2))))
    if kind in ("and", "or"):
        parts = [draw(mask_mods(L, S, B, H, depth + 1)) for _ in range(2)]
        return (M.and_masks if kind == "and" else M.or_masks)(*parts)
    if kind == "custom per head" and H > 1:
        table = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).random((H, L, S)) < draw(
            st.sampled_from([0.1, 0.5, 0.95]))
        return M.MaskMod(lambda b, h, q, kv: table[h, q, kv])
    if kind in ("custom", "custom per head"):
        density = draw(st.sampled_from([0.05, 0.5, 0.97]))
        table = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).random((L, S)) < density
        return M.MaskMod(lambda b, h, q, kv: table[q, kv])
    return M.causal()


@st.composite
def moved_limits(draw, small: bool, tiles: bool = False):
    """The engine's thresholds moved so that small problems take the paths and cuts of large ones."""
    pick = lambda name, values: draw(st.sampled_from(values), label=name)       # noqa: E731
    lim = dict(kernel_min=0, serial_below_flops=0,
               block_q=pick("block_q", [8, 16, 64, 256]), block_k=pick("block_k", [8, 32, 128, 512]),
               block_q_plain=pick("block_q_plain", [16, 64, 512]), block_k_plain=pick("block_k_plain", [16, 64, 512]),
               band_rows_plain=pick("band_rows_plain", [4, 16, 64]),
               band_keys_plain=pick("band_keys_plain", [16, 48, 256]),
               diagonal_min=pick("diagonal_min", [4, 16, 64]), diagonal_min_plain=pick("diagonal_min_plain", [4, 32]),
               block_q_tiles=pick("block_q_tiles", [16, 64, 1024]),
               strip_rows_tiles=pick("strip_rows_tiles", [4, 16, 64]),
               grid_cell=pick("grid_cell", [4, 16, 32]), grid_cell_backward=pick("grid_cell_backward", [8, 32]),
               grid_call_cost=pick("grid_call_cost", [0.0, 2.0, 64.0]),
               band_group_scores=pick("band_group_scores", [64, 4096]),
               split_k_min_blocks=pick("split_k_min_blocks", [1, 2]),
               split_k_min_part_keys=pick("split_k_min_part_keys", [4, 64]),
               plain_loop=draw(st.booleans()) or small or tiles, tile_loop=draw(st.booleans()) or small or tiles,
               group_gqa=draw(st.booleans()))
    if not tiles and draw(st.integers(0, 3)) == 0:
        lim["shift_free_bound"] = 1e-3                    # the rescaled and lazy strategies
    return lim


@st.composite
def problems(draw, block_masks: bool, tiles: bool = False):
    """``(q, k, v, kwargs, limits, threads)`` of a random problem; ``tiles``: one the tile loop takes (a block mask,
    small scores, no score mod, no attn_mask — documents more often)."""
    if draw(st.integers(0, 6), label="decode-like") == 0:     # few rows, one head: split-K's parts
        L, S, B, Hk, rep = draw(st.integers(1, 16)), draw(st.integers(16, 300)), 1, 1, 1
    else:
        L = draw(st.integers(1, 200 if tiles else 300), label="L")
        S = L if draw(st.booleans()) else draw(st.integers(1, 200 if tiles else 300), label="S")
        B, Hk, rep = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    H = Hk * rep
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    size = 0.05 if tiles else draw(st.sampled_from([0.05, 0.05, 3.0]))           # small scores: shift-free; large: the running max
    q = (rng.standard_normal((B, H, L, 4)) * size).astype(np.float32)
    k = (rng.standard_normal((B, Hk, S, 4)) * size).astype(np.float32)
    v = rng.standard_normal((B, Hk, S, 4)).astype(np.float32)
    kw = dict(enable_gqa=rep > 1, is_causal=draw(st.booleans()))
    if block_masks:
        mod = draw(documents(L, B)) if tiles and L == S and draw(st.booleans()) else draw(mask_mods(L, S, B, H))
        bs = draw(st.sampled_from([8, 16, 24, 32, 64, 128] if tiles else [4, 8, 16, 32, 64, 128]), label="BLOCK_SIZE")
        kw["block_mask"] = qkv.create_block_mask(mod, B, H, L, S, BLOCK_SIZE=bs)
    mask = None if tiles else draw(st.sampled_from([None] * (10 if block_masks else 2) + ["bool", "float",
                                                                                          "bottom-right"]))
    if mask == "bool":
        kw["attn_mask"] = rng.random((L, S)) < 0.7
    elif mask == "float":
        kw["attn_mask"] = np.where(rng.random((L, S)) < 0.7, 0.0, -np.inf).astype(np.float32)
    elif mask == "bottom-right":
        kw["attn_mask"] = qkv.masks.causal(L, S, align="bottom-right")
    if mask is not None:
        kw["is_causal"] = False
    score = None if tiles else draw(st.sampled_from([None] * (24 if block_masks else 8) + ["alibi", "softcap", "both", "custom"]))
    if score is not None:
        kw["score_mod"] = {"alibi": lambda: M.alibi(M.alibi_slopes(H)), "softcap": lambda: M.softcap(20.0),
                           "both": lambda: M.compose(M.alibi(M.alibi_slopes(H)), M.softcap(20.0)),
                           "custom": lambda: M.ScoreMod(lambda s, b, h, q, kv: s * 0.5,
                                                        grad=lambda s, b, h, q, kv: np.full_like(s, 0.5))}[score]()
    if mask is None and draw(st.integers(0, 3)) == 0:
        kw["sink_logits"] = np.zeros(H, np.float32)
    return q, k, v, kw, draw(moved_limits(L * S < 4096, tiles)), draw(st.integers(1, 3), label="threads")


def _prove(problem, backward: bool):
    q, k, v, kw, lim, threads = problem
    with limits(**lim):
        p = qkv.plan(q, k, v, backward=backward, backend="tiled", threads=threads, **kw)
    assert p.tasks, "the tiled engine made no tasks"
    proof.check(p, meaning=_meaning(q, k, kw))                # held to the test's own reading of the arguments
    return p


def _meaning(q, k, kw):
    """``head -> (L, S)`` bool: what the arguments allow, read here from the drawn arguments alone (is_causal
    top-left, the attn_mask, the block mask's mod at the head's batch row and head), not from the plan."""
    L, S = q.shape[-2], k.shape[-2]
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]

    def allowed(head):
        a = np.ones((L, S), bool)
        if kw.get("is_causal"):
            a &= j <= i
        m = kw.get("attn_mask")
        if m is not None:
            a &= m if m.dtype == np.bool_ else m > -np.inf
        bm = kw.get("block_mask")
        if bm is not None:
            b, h = (int(x) for x in bm.index_arrays(*head))
            a &= np.broadcast_to(bm.mask_mod(np.asarray(b), np.asarray(h), i, j), (L, S))
        return a
    return allowed


@sweep(2200)
@given(problems(block_masks=True))
def test_block_mask_forward_plans_cover_each_allowed_score_once(problem):
    _prove(problem, backward=False)


@sweep(1500)
@given(problems(block_masks=True, tiles=True))
def test_tile_loop_plans_cover_each_allowed_score_once(problem):
    p = _prove(problem, backward=False)
    assert not proof.untidy(p)                                # and spend nothing on edges or tiles that mask nothing
    TILE_LOOP.append(any(t.strategy == "compiled loop, tiles" for t in p.tasks))


def test_the_tile_loop_sweep_reached_the_tile_loop():
    """(After the sweep, in the same process: most of its plans took the tile loop.)"""
    if not TILE_LOOP:
        pytest.skip("the sweep ran on another worker")
    assert sum(TILE_LOOP) > 0.5 * len(TILE_LOOP), (sum(TILE_LOOP), len(TILE_LOOP))


@sweep(1800)
@given(problems(block_masks=True))
def test_block_mask_backward_plans_cover_each_allowed_score_once(problem):
    _prove(problem, backward=True)


@sweep(2400)
@given(problems(block_masks=False))
def test_masks_causal_and_plain_forward_plans_cover_each_allowed_score_once(problem):
    _prove(problem, backward=False)


@sweep(2100)
@given(problems(block_masks=False))
def test_masks_causal_and_plain_backward_plans_cover_each_allowed_score_once(problem):
    _prove(problem, backward=True)


def test_a_split_k_part_never_takes_the_whole_tile_plan():
    """Found by the sweep: with split-K (few rows, block_k given) each part ran the task's whole tile plan, every
    key kept once per part. A part now takes the other strategies; its plan and its output are right."""
    pytest.importorskip("numba")
    r = np.random.default_rng(3)
    q = (r.standard_normal((1, 1, 1, 4)) * 0.05).astype(np.float32)
    k, v = ((r.standard_normal((1, 1, 25, 4)) * 0.05).astype(np.float32) for _ in range(2))
    bm = qkv.create_block_mask(M.causal(), 1, 1, 1, 25, BLOCK_SIZE=4)
    moved = dict(kernel_min=0, serial_below_flops=0, split_k_min_blocks=1, split_k_min_part_keys=4)
    with limits(**moved):
        p = qkv.plan(q, k, v, block_mask=bm, backend="tiled", threads=2, sink_logits=np.zeros(1, np.float32))
        assert p.split_k == 2
        proof.check(p)
        out = qkv.flex_attention(q, k, v, None, bm, backend="tiled", threads=2, sink_logits=np.zeros(1, np.float32))
    ref = qkv.flex_attention(*(a.astype(np.float64) for a in (q, k, v)), None, bm, backend="reference",
                             sink_logits=np.zeros(1))
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=0)


def test_the_checker_finds_a_plan_that_keeps_a_score_twice():
    """The checker is not vacuous: a tile plan with one piece repeated fails, naming the score and the task."""
    pytest.importorskip("numba")
    import dataclasses
    r = np.random.default_rng(0)
    q, k, v = ((r.standard_normal((1, 1, 600, 8)) * 0.05).astype(np.float32) for _ in range(3))
    bm = qkv.create_block_mask(M.document(np.arange(600) // 150), None, None, 600, 600)
    p = qkv.plan(q, k, v, block_mask=bm, backend="tiled")
    proof.check(p)
    t = p.tasks[0]
    bad = dataclasses.replace(p, tasks=(dataclasses.replace(t, pieces=t.pieces + t.pieces[-1:]),) + p.tasks[1:])
    with pytest.raises(proof.PlanError, match=r"kept 2×, allowed True — task head"):
        proof.check(bad)
    fresh = dataclasses.replace(t.pieces[0], fresh=False)
    bad = dataclasses.replace(p, tasks=(dataclasses.replace(t, pieces=(fresh,) + t.pieces[1:]),) + p.tasks[1:])
    with pytest.raises(proof.PlanError, match="which no earlier piece wrote"):
        proof.check(bad)
