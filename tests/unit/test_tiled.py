"""The tiled engine against the reference backend and torch's SDPA.

Small block sizes (passed to ``tiled.forward``) put block boundaries, partial blocks and skipped blocks into
inputs of a few dozen tokens, so the whole file runs in seconds.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv_tolerances import TOL
from qkv.backends import tiled
from qkv.backends.reference import REFERENCE as REF
from qkv.backends.tiled import TILED


@pytest.fixture(autouse=True)
def _parallel_even_when_small():
    """Small test sizes would run on one thread (SERIAL_BELOW_FLOPS); these tests want the pool."""
    with tiled.limits(serial_below_flops=0):
        yield


def _ref(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False, **kw):
    return qkv.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale,
                                            enable_gqa=enable_gqa, backend="reference", **kw)


def _tiled(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False, **kw):
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, w, lse = tiled.forward(q, k, v, attn_mask=mask, is_causal=is_causal, scale=sc, enable_gqa=enable_gqa,
                                return_lse=True, **kw)
    return out, lse


def test_float16_is_computed_in_float32(rng):
    q, k, v = (rng.standard_normal((2, 29, 8)).astype(np.float16) for _ in range(3))
    got = qkv.scaled_dot_product_attention(q, k, v, backend="tiled")
    want = qkv.scaled_dot_product_attention(*(a.astype(np.float32) for a in (q, k, v)), backend="tiled")
    np.testing.assert_array_equal(got, want.astype(np.float16))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_are_zero_with_lse_minus_inf(kind, rng):
    q, k, v = (rng.standard_normal((2, 20, 8)) for _ in range(3))
    mask = rng.random((20, 20)) < 0.5
    mask[:, 0] = True
    mask[[3, 11]] = False                                 # two queries that may attend to nothing
    m = mask if kind == "bool" else np.where(mask, 0.0, -np.inf)
    for big in (1.0, 50.0):                               # shift-free path and running-max path
        out, lse = _tiled(q * big, k, v, m, block_q=4, block_k=6)
        ref, ref_lse = _ref(q * big, k, v, m, return_lse=True)
        assert np.all(out[:, [3, 11]] == 0) and np.all(lse[:, [3, 11]] == -np.inf)
        assert not np.any(np.isnan(out))
        np.testing.assert_allclose(out, ref, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


def test_a_task_runs_the_first_strategy_that_supports_it(rng, monkeypatch):
    """The forward's strategies in their order; each task takes the first whose supports() holds."""
    from qkv import kernels
    fp = tiled.forward_pass
    assert [s.name for s in fp.STRATEGIES] == ["compiled loop, tiles", "compiled loop, mods", "compiled loop, base 2",
                                               "compiled loop, lazy", "batched bands", "shift-free blocks",
                                               "rescaled blocks"]
    taken = []
    real = fp._strategy
    monkeypatch.setattr(fp, "_strategy", lambda P, T: taken.append(real(P, T).name) or real(P, T))
    q, k, v = (rng.standard_normal((1, 2, 256, 16)).astype(np.float32) for _ in range(3))
    window = qkv.create_block_mask(qkv.mods.sliding_window(64), None, None, 256, 256, BLOCK_SIZE=32)
    cases = [(dict(), 1, "shift-free blocks"), (dict(), 6, "rescaled blocks"),
             (dict(block_mask=window), 1, "batched bands"), (dict(block_mask=window), 6, "rescaled blocks"),
             (dict(attn_mask=np.zeros((256, 256), np.float32)), 1, "rescaled blocks")]
    with tiled.limits(plain_loop=False):
        for kw, amp, want in cases:
            taken.clear()
            tiled.forward(q * amp, k, v, scale=0.25, threads=1, **kw)
            assert set(taken) == {want}, (kw.keys(), amp, taken)
    if kernels.get_kernels() == "numba" and kernels.plain_available(qkv.gemm.GEMM.active()):
        with tiled.limits(kernel_min=0):
            for amp, want in ((1, "compiled loop, base 2"), (6, "compiled loop, lazy")):
                taken.clear()
                tiled.forward(q * amp, k, v, scale=0.25, threads=1)
                assert set(taken) == {want}, (amp, taken)
            for amp, want in ((1, "compiled loop, mods"), (6, "compiled loop, mods")):   # a softcap: bounded
                taken.clear()
                tiled.forward(q * amp, k, v, scale=0.25, threads=1, score_mod=qkv.mods.softcap(20.0))
                assert set(taken) == {want}, (amp, taken)
            for amp, want in ((1, "compiled loop, tiles"), (6, "rescaled blocks")):   # a block mask's cells
                taken.clear()
                tiled.forward(q * amp, k, v, scale=0.25, threads=1, block_mask=window)
                assert set(taken) == {want}, (amp, taken)


def test_gqa_matches_repeated_heads(rng, monkeypatch):
    q = rng.standard_normal((2, 6, 30, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 41, 8)).astype(np.float32) for _ in range(2))
    got, _ = _tiled(q, k, v, enable_gqa=True, block_q=7, block_k=9)
    want, _ = _tiled(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), block_q=7, block_k=9)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)       # grouped heads: another GEMM blocking
    with tiled.limits(group_gqa=False):
        per_head, _ = _tiled(q, k, v, enable_gqa=True, block_q=7, block_k=9)
    np.testing.assert_array_equal(per_head, want)                      # a head per task: the same numbers


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S, block_q, block_k", [(37, 53, 4, 8), (53, 37, 5, 16), (300, 300, None, None)])
def test_grouped_query_heads_run_a_group_per_task_with_the_references_numbers(rng, monkeypatch, causal, L, S,
                                                                             block_q, block_k):
    # GQA without masks, mods or sinks: one task per key/value head and query block, the group's rows
    # interleaved (P.q_rows_group); counted, and equal to the reference in float64, lse included.
    B, Hk, rep, E = 2, 2, 3, 16
    q = rng.standard_normal((B, Hk * rep, L, E)) * 2
    k, v = (rng.standard_normal((B, Hk, S, E)) * 2 for _ in range(2))
    groups = []
    real = tiled.forward_pass._forward_task

    def spy(P, idx, i0, i1, *a):
        groups.append((P.group, idx[-1]))
        return real(P, idx, i0, i1, *a)
    monkeypatch.setattr(tiled.forward_pass, "_forward_task", spy)
    kw = dict(scale=0.3, is_causal=causal, enable_gqa=True, return_lse=True)
    out, _, lse = TILED.forward(q, k, v, block_q=block_q, block_k=block_k, **kw)
    assert groups and {g for g, _ in groups} == {rep} and {h % rep for _, h in groups} == {0}
    ref, _, ref_lse = REF.forward(q, k, v, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
    groups.clear()                                                     # a mask: a head per task again
    TILED.forward(q, k, v, attn_mask=np.ones((L, S), bool), block_q=block_q, block_k=block_k, **kw)
    assert {g for g, _ in groups} == {1}


def test_thread_count_does_not_change_results(rng):
    q, k, v = (rng.standard_normal((2, 4, 70, 16)).astype(np.float32) for _ in range(3))
    base, _ = _tiled(q, k, v, threads=1, block_q=16, block_k=32)
    for n in (2, 3, 5):
        got, _ = _tiled(q, k, v, threads=n, block_q=16, block_k=32)
        np.testing.assert_allclose(got, base, atol=1e-6, rtol=1e-6)
    old = qkv.get_num_threads()
    try:
        qkv.set_num_threads(3)
        assert qkv.get_num_threads() == 3
        got = qkv.scaled_dot_product_attention(q, k, v, backend="tiled")
        np.testing.assert_allclose(got, base, atol=1e-6, rtol=1e-6)
    finally:
        qkv.set_num_threads(None)
    assert qkv.get_num_threads() == tiled.default_num_threads() == old


def test_masked_blocks_are_skipped_and_full_blocks_unmasked():
    def plan(i0, i1, S=64, block_k=8, diagonal_min=None):
        lim = tiled.Limits(diagonal_min=diagonal_min) if diagonal_min else None
        P = tiled.plan._Problem(np.zeros((64, 4)), np.zeros((S, 4)), np.zeros((S, 4)), None, True, 1.0, False,
                                limits=lim)
        return P.key_blocks(i0, i1, None, block_k)

    # causal: keys before the row block in full blocks, then the diagonal square
    assert plan(0, 8) == [(0, 8, 0, 8, "causal")]
    assert plan(16, 24) == [(0, 8, 0, 8, "full"), (0, 8, 8, 16, "full"), (0, 8, 16, 24, "causal")]
    # the diagonal square split in quadrants down to DIAGONAL_MIN rows: upper-right skipped
    got = plan(8, 16, block_k=16, diagonal_min=2)
    assert got == [(0, 8, 0, 8, "full"),
                   (0, 2, 8, 10, "causal"), (2, 4, 8, 10, "full"), (2, 4, 10, 12, "causal"),
                   (4, 8, 8, 12, "full"),
                   (4, 6, 12, 14, "causal"), (6, 8, 12, 14, "full"), (6, 8, 14, 16, "causal")]
    # every allowed pair is covered exactly once, and few disallowed ones are computed
    for i0, i1, S in [(8, 16, 64), (0, 13, 64), (5, 31, 20), (40, 64, 30)]:
        seen = np.zeros((i1 - i0, S), int)
        for r0, r1, j0, j1, kind in plan(i0, i1, S=S, block_k=3, diagonal_min=2):
            seen[r0:r1, j0:j1] += 1
            if kind == "full":
                assert np.all(np.arange(j0, j1)[None, :] <= np.arange(i0 + r0, i0 + r1)[:, None])
        allowed = np.arange(S)[None, :] <= np.arange(i0, i1)[:, None]
        assert np.all(seen[allowed] == 1) and seen.max() == 1
        assert seen[~allowed].sum() <= (i1 - i0) * 2
    win = qkv.masks.sliding_window(32, window=4)
    P = tiled.plan._Problem(np.zeros((32, 4)), np.zeros((32, 4)), np.zeros((32, 4)), win, False, 1.0, False)
    blocks = P.key_blocks(16, 24, P.mask2d(()), 8)
    assert [b[2:4] for b in blocks] == [(8, 16), (16, 24)]      # keys 0..7 are out of every row's window
    assert all(kind == "mask" for *_, kind in blocks)
    allowed = np.ones((32, 32), bool)
    P = tiled.plan._Problem(np.zeros((32, 4)), np.zeros((32, 4)), np.zeros((32, 4)), allowed, False, 1.0, False)
    assert all(kind == "full" for *_, kind in P.key_blocks(0, 8, P.mask2d(()), 8))


def test_dropout_reproducible_independent_of_threads(rng):
    q, k, v = (rng.standard_normal((2, 3, 40, 8)) for _ in range(3))
    sc = 1 / math.sqrt(8)
    runs = [tiled.forward(q, k, v, dropout_p=0.3, scale=sc, rng=np.random.default_rng(5), threads=t,
                          return_weights=True, block_q=8, block_k=16)[:2] for t in (1, 2)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    out, w = runs[0]
    np.testing.assert_allclose(out, w @ v, atol=1e-12)                # the output uses exactly these weights
    dropped = (w == 0).mean()
    assert 0.2 < dropped < 0.4                                         # about p of the weights are dropped
    kept = qkv.scaled_dot_product_attention(q, k, v, return_weights=True, backend="reference")[1]
    np.testing.assert_allclose(w[w > 0], (kept / 0.7)[w > 0], rtol=1e-12)
    other = tiled.forward(q, k, v, dropout_p=0.3, scale=sc, rng=np.random.default_rng(6), block_q=8,
                          block_k=16)[0]
    assert not np.allclose(other, out)


def test_return_weights_from_tiled(rng):
    q, k, v = (rng.standard_normal((2, 2, 21, 8)).astype(np.float32) for _ in range(3))
    mask = qkv.masks.sliding_window(21, window=4, causal=False)
    out, w = qkv.scaled_dot_product_attention(q, k, v, mask, return_weights=True, backend="tiled")
    ref_out, ref_w = qkv.scaled_dot_product_attention(q, k, v, mask, return_weights=True, backend="reference")
    np.testing.assert_allclose(w, ref_w, atol=1e-6)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)


def test_attention_weights_rows_equal_full_weights(rng):
    q = rng.standard_normal((2, 4, 30, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 25, 8)).astype(np.float32)
    mask = rng.random((2, 1, 30, 25)) < 0.6
    mask[..., 0] = True
    mask[0, 0, 7] = False                                             # a fully masked row, batch 0
    for kw in (dict(attn_mask=mask), dict(is_causal=True), dict(scale=0.3)):
        _, full = qkv.scaled_dot_product_attention(q, k, k, enable_gqa=True, return_weights=True,
                                                   backend="reference", **kw)
        rows = [7, 0, -1, 12]
        got = qkv.attention_weights(q, k, rows, enable_gqa=True, **kw)
        assert got.shape == (2, 4, 4, 25) and got.dtype == np.float32
        np.testing.assert_allclose(got, full[..., [7, 0, 29, 12], :], atol=1e-6)
        one = qkv.attention_weights(q, k, 12, enable_gqa=True, **kw)
        np.testing.assert_allclose(one, full[..., [12], :], atol=1e-6)


def test_attention_weights_of_one_token_of_a_long_sequence():
    r = np.random.default_rng(0)
    q = r.standard_normal((1, 100_000, 16)).astype(np.float32)
    w = qkv.attention_weights(q, q, [99_999, 5], is_causal=True)
    assert w.shape == (1, 2, 100_000)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    assert np.all(w[0, 1, 6:] == 0)                                   # row 5 sees keys 0..5
    s = (q[0, 5] @ q[0, :6].T) / 4
    np.testing.assert_allclose(w[0, 1, :6], np.exp(s - s.max()) / np.exp(s - s.max()).sum(), rtol=1e-5)


@pytest.mark.parametrize("bad, err", [("x", TypeError), (1.5, TypeError), ([], TypeError), ([3, 30], ValueError),
                                      (-31, ValueError), (True, TypeError), ([[1]], TypeError)])
def test_attention_weights_bad_rows(bad, err):
    q = np.zeros((30, 4))
    with pytest.raises(err, match="rows"):
        qkv.attention_weights(q, q, bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("order", ["rising", "falling", "zigzag"])
def test_running_max_paths(order, dtype):
    # Scores far outside the shift-free bound: each key block raises the max by 50 (rising: every block
    # is redone with a max pass and rescales), lowers it (falling: later blocks underflow harmlessly
    # against the running max), or alternates; all equal the reference.
    S = 24
    steps = {"rising": np.arange(S), "falling": -np.arange(S), "zigzag": (np.arange(S) % 2) * 3 - 1.0}[order]
    q = np.array([[[1.0], [0.5], [-0.25]]], dtype)                       # (1, 3, 1)
    k = (50.0 * steps).astype(dtype)[None, :, None]                      # (1, S, 1)
    v = np.random.default_rng(0).standard_normal((1, S, 4)).astype(dtype)
    for bk in (1, 5, S):
        got, lse = _tiled(q, k, v, scale=1.0, block_k=bk)
        ref, ref_lse = _ref(q, k, v, scale=1.0, return_lse=True)
        np.testing.assert_allclose(got, ref, **TOL[dtype])
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_memory_stays_linear_never_the_score_matrix():
    # N = 8192, 1 head: the scores would take 256 MB; the tiled forward and backward allocate a few MB
    # (inputs, output, per-head copies, one block per worker), measured by NumPy's tracemalloc hooks.
    import tracemalloc
    r = np.random.default_rng(0)
    n, e = 8192, 16
    q, k, v, go = (r.standard_normal((1, n, e), dtype=np.float32) for _ in range(4))
    scores_bytes = n * n * 4
    for fn in (lambda: qkv.scaled_dot_product_attention(q, k, v, is_causal=True),
               lambda: qkv.scaled_dot_product_attention_backward(go, q, k, v)):
        fn()                                  # once untraced: a library's first use (numba's import) is not the engine's
        tracemalloc.start()
        try:
            fn()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < scores_bytes / 16, peak                         # < 16 MB


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 6), L=st.integers(1, 700), S=st.integers(1, 900), threads=st.integers(2, 5),
       causal=st.booleans())
def test_row_shares_cover_every_row_once_in_shares_of_equal_work(heads, L, S, threads, causal):
    """Few heads on several workers: the pieces cover each head's rows once, cut at multiples of 16, largest
    first; laid end to end, a cut (or a head's end) lies within 8 rows' work (+ one row) of each equal share."""
    from qkv.backends.tiled.setup import _row_shares

    class P:
        pass
    P.L, P.S, P.is_causal = L, S, causal
    pieces = _row_shares(P, heads, threads)
    seen = np.minimum(np.arange(1, L + 1), S) if causal else np.full(L, S)
    cum = np.concatenate(([0], np.cumsum(seen)))
    ends = set()
    for h in range(heads):
        mine = sorted((a, b) for g, a, b in pieces if g == h)
        assert [a for a, _ in mine] == [0] + [b for _, b in mine[:-1]] and mine[-1][1] == L
        assert all(a % 16 == 0 for a, _ in mine)
        ends |= {h * int(cum[-1]) + int(cum[a]) for a, _ in mine} | {(h + 1) * int(cum[-1])}
    work = [int(cum[b] - cum[a]) for _, a, b in pieces]
    assert work == sorted(work, reverse=True)
    total = heads * int(cum[-1])
    for t in range(1, threads):
        assert min(abs(e - t * total / threads) for e in ends) <= 9 * S, (t, sorted(ends))


@pytest.mark.parametrize("provider,heads,want", [
    ("auto", (9, 3, 3), [(0, 368), (0, 512), (0, 512), (368, 512)]),      # SmolLM2's: 4 tasks, halving made 6
    ("auto", (3, 1, 1), [(0, 368), (368, 512)]),
    ("numpy", (3, 1, 1), [(0, 368), (368, 512)])])                         # NumPy's passes, BLOCK_Q halved
def test_few_heads_on_two_workers_run_in_one_share_a_worker_and_equal_the_reference(rng, provider, heads, want):
    """Grouped heads, 512 rows, causal, where the query block would be halved for want of tasks: one share of
    equal work a worker, and the same output as the reference, on either block-kernel provider."""
    from qkv import kernels

    q, k, v = (rng.standard_normal((1, h, 512, 32)).astype(np.float32) for h in heads)
    rows = []
    real = tiled.forward_pass._forward_task
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels.KERNELS, "choice", provider)
        m.setattr(tiled.forward_pass, "_forward_task",
                  lambda P, idx, i0, i1, *a, **kw: (rows.append((i0, i1)), real(P, idx, i0, i1, *a, **kw)))
        got = tiled.forward(q, k, v, scale=0.2, is_causal=True, enable_gqa=True, threads=2)[0]
    assert sorted(rows) == want
    want_out = REF.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale=0.2,
                           is_causal=True, enable_gqa=True)[0]
    np.testing.assert_allclose(got, want_out, **TOL[np.float32])
