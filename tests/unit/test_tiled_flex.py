"""The tiled engine's flex attention (score mods, block masks, sinks) against the reference backend.

Small BLOCK_SIZEs and block sizes put empty, full and partial cells, skipped blocks and rectangles that span
rows of different reach into a few dozen tokens, so the whole file runs in seconds. Amplitude 1 keeps the
scores within the shift-free bound, amplitude 8 drives the lazy/max-pass strategies.
"""
import math

import numpy as np
import pytest

from qkv_tolerances import TOL
from qkv import backends, mods
from qkv.backends import tiled
from qkv.blockmask import create_block_mask

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

TILED = backends.get("tiled")
REF = backends.get("reference")


@pytest.fixture(autouse=True)
def _parallel_even_when_small():
    """Small test sizes would run on one thread (SERIAL_BELOW_FLOPS); these tests want the pool."""
    with tiled.limits(serial_below_flops=0):
        yield


def _inputs(seed, B, Hq, Hk, L, S, E=8, Ev=6, dtype=np.float64, amp=1.0):
    r = np.random.default_rng(seed)
    q = (amp * r.standard_normal((B, Hq, L, E))).astype(dtype)
    k = r.standard_normal((B, Hk, S, E)).astype(dtype)
    v = r.standard_normal((B, Hk, S, Ev)).astype(dtype)
    go = r.standard_normal((B, Hq, L, Ev)).astype(dtype)
    return q, k, v, go


def _dead_rows(b, h, q_idx, kv_idx):
    """Causal, but every fifth query (2, 7, …) may attend to nothing."""
    return (q_idx % 5 != 2) & (kv_idx <= q_idx)


def _custom_mask(b, h, q_idx, kv_idx):
    """No known block structure: evaluated per partial cell; depends on b and h."""
    return ((q_idx + 2 * kv_idx + h + b) % 3 != 0) | (q_idx == kv_idx)


def _mask_mods(B, L, S):
    n = max(L, S)
    lengths = [n // 3, n // 4, n - n // 3 - n // 4]
    ids2 = np.stack([np.repeat(np.arange(3), lengths), np.repeat(np.arange(2), [n // 2, n - n // 2])])
    return {
        "none": None,
        "causal": mods.causal(),
        "window": mods.sliding_window(5),
        "prefix_lm": mods.prefix_lm(6),
        "document": mods.document_from_lengths(lengths),
        "document_2d": mods.document(ids2[:B]),
        "streaming": mods.or_masks(mods.sinks(3), mods.sliding_window(4)),
        "causal_document": mods.and_masks(mods.causal(), mods.document_from_lengths(lengths)),
        "dead_rows": _dead_rows,
        "custom": _custom_mask,
    }


def _custom_score():
    def fn(score, b, h, q_idx, kv_idx):
        return score * (1.0 + 0.25 * h) - 0.5 * b + 0.1 * np.cos(q_idx - kv_idx)

    def grad(score, b, h, q_idx, kv_idx):
        return np.ones((), score.dtype) * (1.0 + 0.25 * h)
    return mods.ScoreMod(fn, grad, name="custom")


def _score_mods(H):
    slopes = mods.alibi_slopes(H) * 4                        # steep: the bias matters within a few keys
    return {
        "none": None,
        "alibi": mods.alibi(slopes),
        "softcap": mods.softcap(1.5),
        "softcap_wide": mods.softcap(50.0),
        "alibi_softcap": mods.compose(mods.alibi(slopes), mods.softcap(3.0)),
        "custom": _custom_score(),
        "chain": mods.compose(_custom_score(), mods.softcap(4.0)),
    }


def _block_mask(mask_mod, B, H, L, S, bs, per_bh):
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, B if per_bh else None, H if per_bh else None, L, S, BLOCK_SIZE=bs)


def _compare(got, want, dtype, what):
    tol = TOL[dtype] if dtype != np.float32 else dict(atol=3e-5, rtol=3e-5)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (what, i)
        assert not np.isnan(g).any(), (what, i)
        np.testing.assert_allclose(g, w, err_msg=f"{what}[{i}]", **tol)


def _run(q, k, v, go, *, gqa=False, block_q=8, block_k=12, threads=2, backward=True, **kw):
    sc = 1 / math.sqrt(q.shape[-1])
    common = dict(scale=sc, enable_gqa=gqa, **kw)
    out, _, lse = TILED.forward(q, k, v, return_lse=True, threads=threads, block_q=block_q, block_k=block_k,
                                **common)
    rout, _, rlse = REF.forward(q, k, v, return_lse=True, **common)
    res = dict(fwd=((out, lse), (rout, rlse)))
    if backward:
        got = TILED.backward(go, q, k, v, threads=threads, block_q=block_q, block_k=block_k, **common)
        want = REF.backward(go, q, k, v, **common)
        res["bwd"] = (got, want)
    return res


MASKS = list(_mask_mods(2, 40, 40))
SCORES = list(_score_mods(3))


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("score_name", SCORES)
def test_every_mod_matches_reference_float64(mask_name, score_name):
    B, H, L, S = 2, 3, 37, 45
    q, k, v, go = _inputs(hash((mask_name, score_name)) % 1000, B, H, H, L, S)
    mm = _mask_mods(B, L, S)[mask_name]
    bm = _block_mask(mm, B, H, L, S, bs=4, per_bh=mask_name in ("custom", "document_2d"))
    res = _run(q, k, v, go, score_mod=_score_mods(H)[score_name], block_mask=bm)
    _compare(*res["fwd"], np.float64, "forward")
    _compare(*res["bwd"], np.float64, "backward")


@pytest.mark.parametrize("amp", [1.0, 8.0])
@pytest.mark.parametrize("mask_name", ["causal", "window", "streaming", "dead_rows", "custom"])
@pytest.mark.parametrize("score_name", ["none", "alibi", "softcap", "alibi_softcap", "custom"])
def test_sinks_gqa_and_large_scores(amp, mask_name, score_name):
    B, Hq, Hk, L, S = 2, 4, 2, 40, 40
    q, k, v, go = _inputs(7, B, Hq, Hk, L, S, amp=amp)
    mm = _mask_mods(B, L, S)[mask_name]
    bm = _block_mask(mm, B, Hq, L, S, bs=8, per_bh=mask_name == "custom")
    sinks = np.random.default_rng(3).standard_normal(Hq) * 2
    res = _run(q, k, v, go, gqa=True, score_mod=_score_mods(Hq)[score_name], block_mask=bm, sink_logits=sinks,
               block_q=16, block_k=16)
    _compare(*res["fwd"], np.float64, "forward")
    got, want = res["bwd"]
    assert len(got) == 4 and got[3].shape == (Hq,)
    _compare(got, want, np.float64, "backward")


@pytest.mark.parametrize("score_name", SCORES)
@pytest.mark.parametrize("mask_name", ["none", "window", "causal_document", "dead_rows"])
def test_float32(score_name, mask_name):
    B, H, L, S = 1, 3, 70, 70
    q, k, v, go = _inputs(11, B, H, H, L, S, E=16, Ev=16, dtype=np.float32)
    mm = _mask_mods(B, L, S)[mask_name]
    bm = _block_mask(mm, B, H, L, S, bs=16, per_bh=False)
    res = _run(q, k, v, go, score_mod=_score_mods(H)[score_name], block_mask=bm,
               sink_logits=np.float32([0.5, -1.0, 2.0]), block_q=32, block_k=32)
    _compare(*res["fwd"], np.float32, "forward")
    _compare(*res["bwd"], np.float32, "backward")


@pytest.mark.parametrize("score_name", ["none", "alibi", "softcap", "custom"])
@pytest.mark.parametrize("amp", [1.0, 8.0])
def test_is_causal_and_attn_mask_with_score_mods(score_name, amp):
    # the plain engine's block plans (causal quadrants, a boolean mask's slices) with score mods and sinks
    B, H, L, S = 1, 2, 300, 300
    q, k, v, go = _inputs(5, B, H, H, L, S, amp=amp)
    sm = _score_mods(H)[score_name]
    sinks = np.array([1.0, -2.0])
    for kw in (dict(is_causal=True), dict(attn_mask=np.tril(np.ones((L, S), bool), 3) & ~np.tril(np.ones((L, S), bool), -40))):
        res = _run(q, k, v, go, score_mod=sm, sink_logits=sinks, block_q=128, block_k=48, **kw)
        _compare(*res["fwd"], np.float64, "forward")
        _compare(*res["bwd"], np.float64, "backward")


def test_block_mask_with_is_causal_and_attn_mask():
    B, H, L, S = 1, 2, 33, 41
    q, k, v, go = _inputs(9, B, H, H, L, S)
    bm = create_block_mask(mods.prefix_lm(9), None, None, L, S, BLOCK_SIZE=4)
    mask = np.random.default_rng(0).random((L, S)) < 0.7
    for kw in (dict(is_causal=True), dict(attn_mask=mask),
               dict(attn_mask=np.where(mask, 0.0, -np.inf) + 0.3 * np.random.default_rng(1).random((L, S)))):
        res = _run(q, k, v, go, block_mask=bm, score_mod=mods.alibi(mods.alibi_slopes(H)), **kw)
        _compare(*res["fwd"], np.float64, "forward")
        _compare(*res["bwd"], np.float64, "backward")


@pytest.mark.parametrize("L, S, bs, bq, bk", [(37, 45, 4, 8, 12), (45, 37, 8, 4, 4), (64, 64, 16, 16, 16),
                                             (33, 33, 32, 64, 64), (9, 130, 8, 3, 5)])
def test_awkward_lengths_and_block_sizes(L, S, bs, bq, bk):
    B, H = 1, 2
    q, k, v, go = _inputs(L * S, B, H, H, L, S)
    for mm in (mods.sliding_window(7), mods.and_masks(mods.causal(), mods.document_from_lengths([max(L, S) - 10, 10])),
               _dead_rows):
        bm = create_block_mask(mm, None, None, L, S, BLOCK_SIZE=bs)
        res = _run(q, k, v, go, block_mask=bm, score_mod=mods.softcap(2.0), block_q=bq, block_k=bk)
        _compare(*res["fwd"], np.float64, "forward")
        _compare(*res["bwd"], np.float64, "backward")


def test_rows_with_nothing_allowed_are_zero():
    B, H, L, S = 1, 2, 30, 30
    q, k, v, go = _inputs(1, B, H, H, L, S)
    bm = create_block_mask(_dead_rows, None, None, L, S, BLOCK_SIZE=4)
    out, _, lse = TILED.forward(q, k, v, scale=0.3, block_mask=bm, return_lse=True, block_q=8, block_k=8)
    dead = np.arange(L) % 5 == 2
    assert np.all(out[:, :, dead] == 0) and np.all(lse[:, :, dead] == -np.inf)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, ~dead]))
    sinks = np.array([0.5, 1.5])                                 # with sinks: output 0, lse = the sink
    out, _, lse = TILED.forward(q, k, v, scale=0.3, block_mask=bm, sink_logits=sinks, return_lse=True,
                                block_q=8, block_k=8)
    assert np.all(out[:, :, dead] == 0)
    np.testing.assert_allclose(lse[0, :, dead].T, np.broadcast_to(sinks[:, None], (2, dead.sum())))
    grads = TILED.backward(go, q, k, v, scale=0.3, block_mask=bm, sink_logits=sinks, block_q=8, block_k=8)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(grads[0][:, :, dead] == 0)


def test_threads_do_not_change_results():
    B, H, L, S = 2, 3, 64, 64
    q, k, v, go = _inputs(2, B, H, H, L, S, dtype=np.float32)
    bm = create_block_mask(mods.or_masks(mods.sinks(2), mods.sliding_window(9)), None, None, L, S, BLOCK_SIZE=8)
    kw = dict(scale=0.4, block_mask=bm, score_mod=mods.compose(mods.alibi(mods.alibi_slopes(H)), mods.softcap(5.0)),
              sink_logits=np.float32([0.1, 0.2, 0.3]), block_q=16, block_k=16)
    f1 = TILED.forward(q, k, v, threads=1, return_lse=True, **kw)
    f2 = TILED.forward(q, k, v, threads=2, return_lse=True, **kw)
    np.testing.assert_array_equal(f1[0], f2[0])                  # the forward's tasks do not depend on threads
    np.testing.assert_array_equal(f1[2], f2[2])
    b1 = TILED.backward(go, q, k, v, threads=1, **kw)
    b2 = TILED.backward(go, q, k, v, threads=2, **kw)
    for g1, g2 in zip(b1, b2):                                   # dQ partials summed in another order
        np.testing.assert_allclose(g1, g2, atol=1e-6, rtol=1e-6)


def test_default_blocks_long_window_matches_reference():
    # the engine's own block sizes (128-row cell bands against the window's run of keys) and BLOCK_SIZE 128
    B, H, L = 1, 2, 1000
    q, k, v, go = _inputs(4, B, H, H, L, L, E=16, Ev=16, dtype=np.float32)
    bm = create_block_mask(mods.sliding_window(200), None, None, L, L)
    sc = 0.25
    for sm in (None, mods.alibi(mods.alibi_slopes(H)), mods.softcap(20.0)):
        out, _, lse = TILED.forward(q, k, v, scale=sc, block_mask=bm, score_mod=sm, return_lse=True)
        rout, _, rlse = REF.forward(q, k, v, scale=sc, block_mask=bm, score_mod=sm, return_lse=True)
        _compare((out, lse), (rout, rlse), np.float32, "forward")
    got = TILED.backward(go, q, k, v, scale=sc, block_mask=bm)
    want = REF.backward(go, q, k, v, scale=sc, block_mask=bm)
    _compare(got, want, np.float32, "backward")


# --------------------------------------------------------------------------------------- what is computed
def _plan_coverage(P, L, S, bq):
    """How often each (query, key) pair is computed by the forward's plan, and which are masked."""
    seen = np.zeros((L, S), int)
    for i0 in range(0, L, bq):
        i1 = min(i0 + bq, L)
        for r0, r1, j0, j1, kind in P.key_blocks(i0, i1, None, 10**9, (0, 0)):
            seen[i0 + r0:i0 + r1, j0:j1] += 1
    return seen


@pytest.mark.parametrize("mm", [mods.sliding_window(10), mods.causal(), mods.document_from_lengths([20, 13, 31]),
                                mods.or_masks(mods.sinks(4), mods.sliding_window(6)), _dead_rows])
def test_plan_covers_allowed_pairs_once_and_skips_empty_cells(mm):
    L = S = 64
    bs = 4
    bm = create_block_mask(mm, None, None, L, S, BLOCK_SIZE=bs)
    z = np.zeros((1, 1, L, 8))
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    P = P.with_cut(tiled.plan.Cut(fwd_budget=10**9))
    seen = _plan_coverage(P, L, S, 16)
    allowed = bm.dense((1, 1), L, S).reshape(L, S)
    assert np.all(seen[allowed] == 1) and seen.max() <= 1
    empty = np.repeat(np.repeat(bm.kinds[0, 0] == 0, bs, 0), bs, 1)[:L, :S]
    computed_empty = (seen > 0) & empty
    # an empty cell is computed only inside a rectangle spanning rows of different reach: a minority
    assert computed_empty.sum() <= 0.25 * (seen > 0).sum()
    assert (seen > 0).sum() < L * S * (0.75 if mm is not _dead_rows else 0.65) or mm is not _dead_rows


def test_empty_blocks_are_skipped_and_full_cells_never_masked():
    # A counting score mod sees every block the engine computes; a counting mask mod every cell it masks.
    L = S = 512
    window, bs = 32, 16
    calls, mask_calls = [], []

    def score(score, b, h, q_idx, kv_idx):
        calls.append((int(q_idx[0, 0]), int(q_idx[-1, 0]) + 1, int(kv_idx[0, 0]), int(kv_idx[0, -1]) + 1))
        return score

    def grad(score, b, h, q_idx, kv_idx):
        return np.ones((), score.dtype)

    inner = mods.sliding_window(window)

    def window_mask(b, h, q_idx, kv_idx):
        mask_calls.append((int(q_idx[0, 0]), int(q_idx[-1, 0]) + 1, int(kv_idx[0, 0]), int(kv_idx[0, -1]) + 1))
        return inner(b, h, q_idx, kv_idx)
    mm = mods.MaskMod(window_mask, block_kinds=inner.block_kinds)   # not a built-in: evaluated per cell
    bm = create_block_mask(mm, None, None, L, S, BLOCK_SIZE=bs)
    q, k, v, go = _inputs(0, 1, 1, 1, L, S, E=8, Ev=8)
    calls.clear()
    mask_calls.clear()
    out, _, _ = TILED.forward(q, k, v, scale=0.3, block_mask=bm, score_mod=mods.ScoreMod(score, grad), block_q=64)
    computed = sum((a1 - a0) * (c1 - c0) for a0, a1, c0, c1 in calls)
    assert computed <= L * (window + 2 * bs)                     # the band, not L·S = 262144
    for a0, a1, c0, c1 in calls:                                 # no call is outside the window
        assert c0 <= a1 - 1 and c1 - 1 >= a0 - window + 1
    cells = bm.kinds[0, 0]
    for a0, a1, c0, c1 in mask_calls:                            # the mask mod only on partial cells
        assert np.all(cells[a0 // bs:-(-a1 // bs), c0 // bs:-(-c1 // bs)] == 1), (a0, a1, c0, c1)
    assert len(mask_calls) <= 2 * L // bs
    ref = REF.forward(q, k, v, scale=0.3, block_mask=bm)[0]
    np.testing.assert_allclose(out, ref, atol=1e-10)
    # the backward computes the same band
    calls.clear()
    TILED.backward(go, q, k, v, scale=0.3, block_mask=bm, score_mod=mods.ScoreMod(score, grad),
                   out=out, lse=TILED.forward(q, k, v, scale=0.3, block_mask=bm, return_lse=True)[2])
    computed = sum((a1 - a0) * (c1 - c0) for a0, a1, c0, c1 in calls)
    assert computed <= L * (window + 4 * bs)


def test_aligned_documents_never_evaluate_the_mask_mod():
    # documents whose edges fall on BLOCK_SIZE multiples: every cell is empty or full, no mask work at all
    L = 256
    inner = mods.document_from_lengths([64, 128, 64])
    n = [0]

    def doc(b, h, q_idx, kv_idx):
        n[0] += 1
        return inner(b, h, q_idx, kv_idx)
    bm = create_block_mask(mods.MaskMod(doc, block_kinds=inner.block_kinds), None, None, L, L, BLOCK_SIZE=32)
    n[0] = 0
    q, k, v, _ = _inputs(3, 1, 2, 2, L, L)
    out = TILED.forward(q, k, v, scale=0.3, block_mask=bm)[0]
    assert n[0] == 0
    np.testing.assert_allclose(out, REF.forward(q, k, v, scale=0.3, block_mask=bm)[0], atol=1e-10)


def test_sliding_window_never_allocates_the_score_matrix():
    # N = 8192, 1 head: the scores would take 256 MB; the window's forward and backward a few MB
    import tracemalloc
    n, e = 8192, 16
    r = np.random.default_rng(0)
    q, k, v, go = (r.standard_normal((1, 1, n, e), dtype=np.float32) for _ in range(4))
    bm = create_block_mask(mods.sliding_window(256), None, None, n, n)
    scores_bytes = n * n * 4
    for fn in (lambda: TILED.forward(q, k, v, scale=0.25, block_mask=bm, score_mod=mods.alibi([0.5])),
               lambda: TILED.backward(go, q, k, v, scale=0.25, block_mask=bm, score_mod=mods.softcap(20.0),
                                      sink_logits=np.float32([1.0]))):
        fn()                                                     # caches (patterns, scratch) warm
        tracemalloc.start()
        try:
            fn()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < scores_bytes / 16, peak                    # < 16 MB


def test_features_and_shift_free_rules():
    assert {"score_mod", "block_mask", "sinks"} <= TILED.features
    assert TILED.supports(score_mod=mods.softcap(5), block_mask=object(), sink_logits=np.zeros(2),
                          backward=True) is None
    z = np.zeros((1, 2, 16, 4))
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, score_mod=mods.softcap(50.0))
    assert P.mod.kind == "softcap" and P.shift_free(1e6, 70.0, None)        # bounded by the cap
    assert not P.shift_free(1e6, 45.0, None)                                  # too little room for exp(50)
    P = tiled.plan._Problem(z, z, z, None, True, 1.0, False, score_mod=mods.alibi([0.5, 0.25]))
    assert P.mod.kind == "alibi" and P.shift_free(10.0, 70.0, 0.5)           # causal: bias ≤ 0, diagonal 0
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, score_mod=mods.alibi([0.5, 0.25]))
    assert not P.shift_free(10.0, 70.0, 0.5)                                  # future keys: bias > 0
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, score_mod=_custom_score())
    assert P.mod.kind == "generic" and not P.shift_free(0.0, 70.0, None)


def test_the_engine_reads_a_mods_traits_never_its_name():
    """A mod is what its traits say (qkv.mods.ScoreTraits / MaskTraits), not what its function is called: a
    custom mod under a built-in's name and module is called on every block; one declaring a cap is folded."""
    from qkv import paths
    z = np.zeros((1, 2, 16, 4))

    def softcap_mod(score, b, h, q_idx, kv_idx):              # a built-in's name and module, but a user's mod
        return 5.0 * np.tanh(score / 5.0)
    softcap_mod.__module__ = "qkv.mods"
    spoof = mods.ScoreMod(softcap_mod, lambda s, b, h, i, j: 1 - np.tanh(s / 5.0) ** 2, name="softcap")
    assert tiled.plan._Problem(z, z, z, None, False, 1.0, False, score_mod=spoof).mod.kind == "generic"
    declared = mods.ScoreMod(softcap_mod, spoof._grad, traits=mods.ScoreTraits(cap=5.0))
    assert tiled.plan._Problem(z, z, z, None, False, 1.0, False, score_mod=declared).mod.kind == "softcap"
    chain = mods.compose(mods.alibi([0.5, 0.25]), declared)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, score_mod=chain)
    assert P.mod.kind == "alibi_softcap" and P.mod.cap == 5.0
    q, k, v, go = _inputs(3, 1, 2, 2, 40, 40, amp=4.0)
    want = REF.forward(q, k, v, score_mod=spoof, scale=0.5)[0]
    for mod, path in ((spoof, "score.generic"), (declared, "score.softcap_tanh")):
        with paths.counting() as seen:
            got = TILED.forward(q, k, v, score_mod=mod, scale=0.5, block_q=8, block_k=16)[0]
        assert seen[path] > 0 and (path == "score.generic") == (seen["score.generic"] > 0), seen
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)

    def causal_mask(b, h, q_idx, kv_idx):                      # a mask mod under a built-in's name: no traits
        return q_idx >= kv_idx
    causal_mask.__module__ = "qkv.mods"
    bm = create_block_mask(causal_mask, None, None, 16, 16, BLOCK_SIZE=8)
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    assert P.mask_traits == mods.MaskTraits()
    bm = create_block_mask(mods.MaskMod(causal_mask, traits=mods.MaskTraits(True, True, True)), None, None, 16, 16,
                           BLOCK_SIZE=8)
    assert tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm).mask_traits.invariant


@pytest.mark.parametrize("amp", [0.05, 0.5, 1.0, 1.6, 2.5, 4.0])
def test_softcap_polynomial_is_as_exact_as_numpy_tanh(amp):
    # float32 softcap 50: |s/cap| bounded per query block; small bounds take the polynomial, larger np.tanh.
    # Either way the error against float64 is that of the reference's own float32 tanh.
    B, H, L, S, E = 1, 2, 256, 256, 64
    q, k, v, _ = _inputs(8, B, H, H, L, S, E=E, Ev=16, dtype=np.float32, amp=amp)
    sm = mods.softcap(50.0)
    kw = dict(scale=1 / 8, score_mod=sm, return_lse=True)
    out, _, lse = TILED.forward(q, k, v, block_q=64, block_k=64, **kw)
    r32, _, l32 = REF.forward(q, k, v, **kw)
    r64, _, l64 = REF.forward(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    err, err_ref = np.abs(out - r64).max(), np.abs(r32 - r64).max()
    assert err <= 3 * err_ref + 1e-6, (err, err_ref)
    assert np.abs(lse - l64).max() <= 3 * np.abs(l32 - l64).max() + 1e-6


def test_tanh_polynomials():
    for bound in (0.001, 0.03, 0.1, 0.2, 0.29, 0.31, 0.4, 0.5, 0.6, 0.75):
        a = tiled.scoring._tanh_poly(bound)
        assert a is not None and len(a) <= 7
        y = np.linspace(-bound, bound, 2001)
        y = y[y != 0]
        got = y * np.polynomial.Polynomial(a)(y * y)
        assert np.abs(got / np.tanh(y) - 1).max() < 3e-8
    assert tiled.scoring._tanh_poly(0.76) is None and tiled.scoring._tanh_poly(float("nan")) is None


def test_weights_and_dropout_with_block_masks():
    B, H, L, S = 1, 2, 40, 40
    q, k, v, _ = _inputs(6, B, H, H, L, S)
    bm = create_block_mask(mods.or_masks(mods.sinks(2), mods.sliding_window(6)), None, None, L, S, BLOCK_SIZE=4)
    sm = mods.alibi(mods.alibi_slopes(H))
    sinks = np.array([0.5, -0.5])
    out, w, _ = TILED.forward(q, k, v, scale=0.3, block_mask=bm, score_mod=sm, sink_logits=sinks,
                              return_weights=True, block_q=8, block_k=8)
    rout, rw, _ = REF.forward(q, k, v, scale=0.3, block_mask=bm, score_mod=sm, sink_logits=sinks,
                              return_weights=True)
    np.testing.assert_allclose(w, rw, atol=1e-12)
    np.testing.assert_allclose(out, rout, atol=1e-12)
    runs = [TILED.forward(q, k, v, scale=0.3, block_mask=bm, score_mod=sm, dropout_p=0.3, threads=t,
                          rng=np.random.default_rng(5), return_weights=True, block_q=8, block_k=8)[:2]
            for t in (1, 2)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    d_out, d_w = runs[0]
    np.testing.assert_allclose(d_out, d_w @ v, atol=1e-12)     # the output uses exactly these weights
    assert np.all(d_w[rw == 0] == 0) and 0.15 < (d_w[rw > 0] == 0).mean() < 0.45


def test_bench_variants_small(monkeypatch, capsys):
    from qkv import bench
    small = dict(window_n=512, window=64, docs=2, doc_len=128, mods_n=256, backward_n=256, long_n=2048)
    res = bench.variants(heads=2, dim=16, repeats=1, threads=1, progress=False, **small)
    assert {r["case"] for r in res["rows"]} == {"window", "documents", "mods", "backward"}
    assert all(r["median_s"] > 0 for r in res["rows"])
    assert len(res["ratios"]) == len(bench.VARIANT_TARGETS)
    assert all(r["ratio"] is None or r["ratio"] > 0 for r in res["ratios"])
    assert res["long"]["n"] == 2048 and res["long"]["finite"] and res["long"]["peak_rss_mb"] > 0
    md = bench.variants_markdown(res)
    assert "| window / qkv full causal |" in md and "peak RSS" in md
    # the CLI flag, at these sizes
    pytest.importorskip("click")
    from qkv.cli import main
    real = bench.variants
    monkeypatch.setattr(bench, "variants", lambda **kw: real(**{**kw, **small, "long_n": 2048}))
    capsys.readouterr()
    assert main(["bench", "--variants", "--repeats", "1", "--heads", "2", "--dim", "16", "--threads", "1",
                 "--markdown", "--no-progress"]) == 0
    assert "| ratio of medians |" in capsys.readouterr().out


@pytest.mark.parametrize("mm", [mods.sliding_window(100), mods.causal(), mods.document_from_lengths([200, 100, 212]),
                                mods.and_masks(mods.causal(), mods.document_from_lengths([200, 100, 212])),
                                mods.or_masks(mods.sinks(5), mods.sliding_window(70))])
def test_finer_cells_for_built_in_mods(mm):
    # BLOCK_SIZE 128 with a built-in mod: the engine plans on 32-cells forward, 64 backward (their kinds from
    # the mod's own block_kinds), still covering every allowed pair once and never an empty 128-block
    L = S = 512
    bm = create_block_mask(mm, None, None, L, S)
    z = np.zeros((1, 1, L, 8))
    P = tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm)
    assert P.cell == tiled.GRID_CELL == 32
    assert tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=bm, backward=True).cell == 64
    P = P.with_cut(tiled.plan.Cut(fwd_budget=10**9))
    seen = _plan_coverage(P, L, S, 256)
    allowed = bm.dense((1, 1), L, S).reshape(L, S)
    assert np.all(seen[allowed] == 1) and seen.max() <= 1
    coarse_empty = np.repeat(np.repeat(bm.kinds[0, 0] == 0, 128, 0), 128, 1)
    assert not np.any((seen > 0) & coarse_empty)
    q, k, v, go = _inputs(12, 1, 2, 2, L, S)
    res = _run(q, k, v, go, block_mask=bm, score_mod=mods.alibi(mods.alibi_slopes(2)), block_q=256, block_k=256)
    _compare(*res["fwd"], np.float64, "forward")
    _compare(*res["bwd"], np.float64, "backward")
    custom = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, L, S)
    assert tiled.plan._Problem(z, z, z, None, False, 1.0, False, block_mask=custom).cell == 128   # no block_kinds


def test_softcap_polynomial_runs_in_chunks_with_the_same_result(monkeypatch, numpy_kernels):
    # A block larger than POLY_CHUNK scores is evaluated a few rows at a time (to stay in cache): the same
    # numbers as one pass over the block, and the chunked path is really taken.
    q, k, v, _ = _inputs(9, 1, 2, 2, 256, 256, E=64, Ev=16, dtype=np.float32, amp=0.5)
    kw = dict(scale=1 / 8, score_mod=mods.softcap(50.0), block_q=128, block_k=128)
    monkeypatch.setattr(tiled.scoring, "POLY_CHUNK", 1 << 30)
    whole = TILED.forward(q, k, v, **kw)[0]
    calls = []
    real = tiled.scoring._apply_poly_chunk
    monkeypatch.setattr(tiled.scoring, "_apply_poly_chunk", lambda s, poly: (calls.append(s.shape), real(s, poly)))
    monkeypatch.setattr(tiled.scoring, "POLY_CHUNK", 40 * 128)
    chunked = TILED.forward(q, k, v, **kw)[0]
    assert calls and all(rows <= 40 for rows, _ in calls) and any(rows < 128 for rows, _ in calls)
    np.testing.assert_array_equal(chunked, whole)


@pytest.mark.parametrize("provider", ["numba", "numpy"])
@pytest.mark.parametrize("n, causal", [(1024, False), (2048, True)])
def test_a_custom_score_mod_is_applied_on_the_default_path_forward_and_backward(provider, n, causal):
    """Issue 25: the fused kernels' plan used to skip a mod the engine does not know (0.55 off forward,
    1e7 backward). Sizes where backend=None picks the tiled engine and its float32 kernels."""
    from qkv import flex_attention, flex_attention_backward, kernels
    pytest.importorskip("numba") if provider == "numba" else None
    calls = []

    def fn(s, b, h, i, j):
        calls.append(1)
        return s + 0.01 * (i - j)

    f = mods.ScoreMod(fn, grad=lambda s, b, h, i, j: np.ones_like(s))
    r = np.random.default_rng(0)
    q, k, v, do = (r.standard_normal((1, 1, n, 64), dtype=np.float32) for _ in range(4))
    bm = create_block_mask(mods.causal(), 1, 1, n, n) if causal else None
    before = kernels.get_kernels()
    kernels.set_kernels(provider)
    try:
        got = flex_attention(q, k, v, f, bm)
        assert calls, "the mod was never called"
        grads = flex_attention_backward(do, q, k, v, f, bm)
    finally:
        kernels.set_kernels(before)
    want = flex_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), f, bm,
                          backend="reference")
    want_grads = flex_attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), f, bm,
                                         backend="reference")
    assert np.abs(got - want).max() <= 2e-6
    for g, w in zip(grads, want_grads):
        assert np.abs(g - w).max() <= 1e-5 * max(1.0, np.abs(w).max())
