"""The engine's compiled loop of plain blocks (qkv.compute._jit.plain_rows through qkv.kernels.run_plain): shift-free
blocks of unmodified scores, the whole task in numba, its GEMMs by the provider's C sgemm. Checked against
the Python loop it replaces (tiled.limits(plain_loop=False)), the float64 reference, and its own plan."""
import os
import sys
import time

import numpy as np
import pytest

import qkv
from qkv import bench, gemm, kernels, mods
from qkv.backends import tiled

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

pytest.importorskip("numba")

NUMPY_SGEMM = gemm.NumpyGemm().c_sgemm
needs_sgemm = pytest.mark.skipif(NUMPY_SGEMM is None, reason="NumPy's BLAS has no CBLAS sgemm qkv can find")


def _spy(monkeypatch, name: str, real) -> list:
    """The calls of the engine's ``kernels.<name>`` (a compiled loop's entry): the provider each got."""
    calls = []
    monkeypatch.setattr(kernels, name, lambda jit, g, *a: (calls.append(g.name), real(jit, g, *a)))
    monkeypatch.setattr(kernels.KERNELS, "choice", "auto")
    return calls


@pytest.fixture
def plain_calls(monkeypatch):
    """The forward's compiled loop's calls."""
    return _spy(monkeypatch, "run_plain", kernels.run_plain)


def _inputs(rng, H=2, Hk=None, L=700, S=900, E=32, Ev=24, amp=1.0):
    Hk = Hk or H
    q = (rng.standard_normal((1, H, L, E)) * amp).astype(np.float32)
    k = (rng.standard_normal((1, Hk, S, E)) * amp).astype(np.float32)
    v = rng.standard_normal((1, Hk, S, Ev)).astype(np.float32)
    return q, k, v


def _case(rng, spec):
    """Inputs of a table's case: ``(q, k, v, threads, kw)``, the shape keys and ``threads`` taken out of ``kw``,
    ``sinks`` turned into ``sink_logits``, the scale 0.2."""
    kw = dict(spec)
    shape = {n: kw.pop(n) for n in ("H", "Hk", "L", "S", "E", "Ev") if n in kw}
    q, k, v = _inputs(rng, **shape)
    threads = kw.pop("threads", 2)
    if kw.pop("sinks", False):
        kw["sink_logits"] = rng.standard_normal(q.shape[1])
    kw["scale"] = 0.2
    return q, k, v, threads, kw


def _reference(q, k, v, **kw):
    """float64 attention: SDPA's reference, or with ``sink_logits`` (causal) flex attention's."""
    f = np.float64
    if "sink_logits" in kw:
        bm = qkv.create_block_mask(mods.causal(), None, None, q.shape[2], k.shape[2])
        return qkv.flex_attention(q.astype(f), k.astype(f), v.astype(f), scale=kw["scale"], block_mask=bm,
                                  sink_logits=kw["sink_logits"], backend="reference")
    return qkv.scaled_dot_product_attention(q.astype(f), k.astype(f), v.astype(f), backend="reference", **kw)


CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "causal, more queries than keys": dict(L=1100, S=600, is_causal=True),
    "causal, more keys than queries": dict(L=300, S=1500, is_causal=True),
    "odd sizes": dict(L=333, S=1025, E=40, Ev=17),
    "grouped-query causal": dict(H=6, Hk=2, is_causal=True, enable_gqa=True),
    "grouped-query full": dict(H=4, Hk=2, enable_gqa=True),
    "one thread": dict(is_causal=True, threads=1),
    "split-K (one short query block, many keys)": dict(H=1, L=64, S=4096, threads=2),
    "sinks": dict(is_causal=True, sinks=True),
}


@needs_sgemm
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_loop_equals_the_python_loop_and_the_reference(rng, plain_calls, monkeypatch, case):
    q, k, v, threads, kw = _case(rng, CASES[case])
    out, _, lse = tiled.forward(q, k, v, return_lse=True, threads=threads, **kw)
    assert plain_calls and set(plain_calls) == {gemm.GEMM.active().name}
    n = len(plain_calls)
    with tiled.limits(plain_loop=False):
        base, _, base_lse = tiled.forward(q, k, v, return_lse=True, threads=threads, **kw)
    assert len(plain_calls) == n, "plain_loop=False still took the compiled loop"
    # the same products and 2^s; only the order of additions differs (P·V accumulated by the GEMM's beta, the
    # diagonal in smaller squares)
    np.testing.assert_allclose(out, base, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, base_lse, rtol=1e-6, atol=2e-6)
    ref = _reference(q, k, v, **kw)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


NOT_PLAIN = {
    "a boolean mask": dict(mask=True),
    "weights returned": dict(return_weights=True),
    "dropout": dict(dropout_p=0.1, rng=np.random.default_rng(0)),
    "softcap": dict(score_mod=mods.softcap(20.0)),
    "ALiBi": dict(score_mod=mods.alibi(mods.alibi_slopes(2)), is_causal=True),
    "a block mask": dict(block_mask=True),
    "float64": dict(dtype=np.float64),
}


@needs_sgemm
@pytest.mark.parametrize("case", list(NOT_PLAIN))
def test_only_plain_blocks_take_the_compiled_loop(rng, plain_calls, lazy_calls, case):
    kw = dict(NOT_PLAIN[case])
    q, k, v = _inputs(rng)
    dt = kw.pop("dtype", np.float32)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    if kw.pop("mask", False):
        kw["attn_mask"] = rng.random((700, 900)) > 0.3
    if kw.pop("block_mask", False):
        kw["block_mask"] = qkv.create_block_mask(mods.sliding_window(200), None, None, 700, 900)
    for amp in (1.0, 3.0):                                    # bounded scores and lazy ones: neither loop
        tiled.forward(q * amp, k * amp, v, scale=0.2, threads=2, **kw)
    assert plain_calls == [] and lazy_calls == []
    if case != "float64":
        tiled.forward(q, k, v, scale=0.2, threads=2)
        tiled.forward(q * 3, k * 3, v, scale=0.2, threads=2)
        assert plain_calls and lazy_calls, "the same inputs, plain, did not take them (the test would be vacuous)"


def test_the_python_loop_runs_where_numpys_blas_has_no_c_sgemm(rng, plain_calls, monkeypatch):
    monkeypatch.setattr(gemm, "_NUMPY_SGEMM", [None])             # as where NumPy links another BLAS
    monkeypatch.setattr(gemm.GEMM, "_active", gemm.GEMM.provider("numpy"))
    assert gemm.NumpyGemm().c_sgemm is None and not kernels.plain_available(gemm.NumpyGemm())
    q, k, v = _inputs(rng)
    out = tiled.forward(q, k, v, scale=0.2, is_causal=True, threads=2)[0]
    assert plain_calls == []
    np.testing.assert_allclose(out, _reference(q, k, v, scale=0.2, is_causal=True), rtol=2e-5, atol=2e-6)


@needs_sgemm
def test_numpys_c_sgemm_is_its_own_blas_and_takes_leading_dimensions(rng):
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    assert os.path.isdir(libs)                                     # the wheel's bundled OpenBLAS
    a = rng.standard_normal((40, 70), dtype=np.float32)
    b = rng.standard_normal((30, 90), dtype=np.float32)
    c = rng.standard_normal((50, 60), dtype=np.float32)
    want = c[5:25, 3:28] + a[3:23, 10:30] @ b[4:24, 7:32]         # sub-blocks: offsets and leading dimensions
    it = 4
    NUMPY_SGEMM(101, 111, 111, 20, 25, 20, 1.0, a.ctypes.data + it * (3 * 70 + 10), 70,
                b.ctypes.data + it * (4 * 90 + 7), 90, 1.0, c.ctypes.data + it * (5 * 60 + 3), 60)
    np.testing.assert_allclose(c[5:25, 3:28], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L,S", [(1024, 1024), (1024, 4096), (700, 900), (3000, 1000), (64, 64), (200, 3000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bk", [512, tiled.BLOCK_K_PLAIN])
def test_the_plan_covers_every_allowed_pair_once(L, S, causal, bk):
    P = tiled.plan._Problem(np.zeros((L, 8), np.float32), np.zeros((S, 8), np.float32), np.zeros((S, 8), np.float32),
                       None, causal, 1.0, False)
    bq = min(1024, L)
    for i0 in range(0, L, bq):
        i1 = min(i0 + bq, L)
        plan, room = tiled.plan._plain_plan(P, i0, i1, bk, 1, None)
        assert room == max((r1 - r0) * (j1 - j0) for r0, r1, j0, j1, _, _ in plan)   # the scratch it needs
        cover = np.zeros((i1 - i0, S), np.int64)
        seen_rows = np.zeros(i1 - i0, bool)
        computed = 0
        for r0, r1, j0, j1, d, fresh in plan:
            assert r0 < r1 and j0 < j1 <= S and j1 - j0 <= bk
            i = np.arange(i0 + r0, i0 + r1)[:, None]
            j = np.arange(j0, j1)[None, :]
            allowed = np.ones((r1 - r0, j1 - j0), bool) if d == kernels.NO_MASK else (j - j0 <= d + (i - i0 - r0))
            if d != kernels.NO_MASK:
                assert d == i0 + r0 - j0                                 # the kernels' diagonal offset
            np.testing.assert_array_equal(allowed, (j <= i) if causal else True)  # a block masks what causal does
            cover[r0:r1, j0:j1] += allowed
            computed += (r1 - r0) * (j1 - j0)
            assert bool(fresh) == (not seen_rows[r0:r1].any())           # written exactly where nothing was yet
            assert fresh or seen_rows[r0:r1].all()                       # (rows are never half-new)
            seen_rows[r0:r1] = True
        want = (np.arange(i0, i1)[:, None] >= np.arange(S)[None, :]) if causal else np.ones((i1 - i0, S), bool)
        np.testing.assert_array_equal(cover, want.astype(np.int64))     # every allowed pair exactly once
        if causal:                                                       # thrown away: ≤ n·64/2 (+ the clip)
            assert computed - want.sum() <= (i1 - i0) * tiled.DIAGONAL_MIN_PLAIN // 2 + tiled.DIAGONAL_MIN_PLAIN


@needs_sgemm
@pytest.mark.parametrize("block_k,S,want", [(None, 1024, tiled.BLOCK_K_PLAIN), (None, 512, 512), (None, 300, 300),
                                             (512, 1024, 512), (96, 1024, 96)])
def test_the_compiled_loops_key_blocks_are_block_k_plain_unless_block_k_is_given(rng, monkeypatch, block_k, S, want):
    """Without ``block_k`` the compiled loop's blocks are BLOCK_K_PLAIN keys wide (the Python loop's BLOCK_K)
    where the keys are more than one BLOCK_K block (else they stay one); a given ``block_k`` is the width of
    both — before the loop cuts them into pieces of at most BAND_KEYS_PLAIN keys. Either way the result is the
    Python loop's."""
    widths = []
    real = kernels.run_plain

    def spy(jit, g, qs, k_t, v, plan, *a):
        widths.extend(int(w) for w in plan[:, 3] - plan[:, 2])
        return real(jit, g, qs, k_t, v, plan, *a)
    monkeypatch.setattr(kernels, "run_plain", spy)
    monkeypatch.setattr(kernels.KERNELS, "choice", "auto")
    q, k, v = _inputs(rng, H=2, L=1024, S=S, E=32, Ev=32)
    for causal in (False, True):
        widths.clear()
        got = tiled.forward(q, k, v, scale=0.2, is_causal=causal, threads=1, block_k=block_k)[0]
        assert widths and max(widths) == min(want, tiled.BAND_KEYS_PLAIN) or causal and max(widths) <= want
        widths.clear()
        with tiled.limits(band_keys_plain=1 << 30, band_rows_plain=1 << 30):     # the blocks before the cut
            tiled.forward(q, k, v, scale=0.2, is_causal=causal, threads=1, block_k=block_k)
        # (causal: the diagonal's squares may all be narrower than a block)
        assert widths and (max(widths) == want if not causal else max(widths) <= want)
        with tiled.limits(plain_loop=False):
            ref = tiled.forward(q, k, v, scale=0.2, is_causal=causal, threads=1, block_k=block_k)[0]
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


@needs_sgemm
@pytest.mark.parametrize("H,L,threads,block_q,tasks", [(2, 4096, 1, None, 4), (1, 4096, 2, None, 2), (2, 4096, 1, 1024, 8),
                                                       (2, 1500, 1, None, 2), (4, 256, 2, None, 4)])
def test_plain_tasks_take_block_q_plain_rows_unless_block_q_is_given(rng, plain_calls, H, L, threads, block_q,
                                                                     tasks):
    """Where every task runs the compiled loop, a task is BLOCK_Q_PLAIN query rows — or, where there would be
    fewer than two a worker, one share of equal work a worker (one head of 4096 rows on 2: two tasks); a given
    ``block_q`` is kept; a masked problem keeps the Python loop's BLOCK_Q."""
    q, k, v = _inputs(rng, H=H, L=L, S=L, E=16, Ev=16)
    got = tiled.forward(q, k, v, scale=0.2, is_causal=True, threads=threads, block_q=block_q)[0]
    assert len(plain_calls) == tasks
    mask = np.tril(np.ones((L, L), bool))                            # the same attention, as a mask: BLOCK_Q
    blocks = []
    real = tiled.forward_pass._forward_task
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiled.forward_pass, "_forward_task",
                  lambda P, idx, i0, i1, *a: (blocks.append(i1 - i0), real(P, idx, i0, i1, *a)))
        ref = tiled.forward(q, k, v, scale=0.2, attn_mask=mask, threads=threads, block_q=block_q)[0]
    assert max(blocks) == min(block_q or tiled.BLOCK_Q, L) or threads > 1
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


@needs_sgemm
def test_gemm_share_times_the_compiled_loops_gemms(plain_calls):
    rows = bench.gemm_share(256, heads=1, dim=16, repeats=1, torch_sdpa=False, gemms=["numpy"])
    assert plain_calls, "the share's forward did not take the compiled loop (the test is vacuous)"
    full, causal = rows
    # the full forward computes exactly its nominal flops, all in the loop's timed GEMMs
    assert full["gemm_gflops"] * full["gemm_s"] * 1e9 == pytest.approx(bench.flops("forward", 1, 1, 256, 16))
    done = causal["gemm_gflops"] * causal["gemm_s"] * 1e9
    assert bench.flops("causal", 1, 1, 256, 16) < done < 1.25 * bench.flops("causal", 1, 1, 256, 16)
    assert 0 < full["gemm_s"] < full["wall_s"]
    assert gemm.GEMM.provider("numpy").clock is None                # the timer is taken off again


@needs_sgemm
def test_run_plain_times_into_the_providers_clock(rng):
    jit = kernels.KERNELS.jit()
    p = gemm.NumpyGemm()
    qs = rng.standard_normal((256, 17), dtype=np.float32) * np.float32(0.1)
    k_t = rng.standard_normal((17, 512), dtype=np.float32)
    v = rng.standard_normal((512, 8), dtype=np.float32)
    plan = np.array([[0, 256, 0, 512, kernels.NO_MASK, 1]], np.int64)
    acc, l_i = np.zeros((256, 8), np.float32), np.zeros(256, np.float32)
    sums, zeros = np.zeros(256, np.float32), np.zeros(256, np.float32)
    p.clock = clock = np.zeros(2)
    t = time.perf_counter()
    kernels.run_plain(jit, p, qs, k_t, v, plan, np.empty(256 * 512, np.float32), acc, l_i, sums, zeros, 1)
    t = time.perf_counter() - t
    assert 0 < clock[0] <= t and clock[1] == 2 * 256 * 512 * 16 + 2 * 256 * 8 * 512   # E = 16: the last row is 1s
    # the GEMMs timed on the monotonic clock, perf_counter's — read in user space, not the thread CPU clock's
    # system call (which slowed what it timed)
    assert kernels.GEMM_CLOCK == time.CLOCK_MONOTONIC
    if sys.platform.startswith("linux"):                               # (elsewhere perf_counter has its own)
        assert "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation
    p2 = np.exp2(qs[:, :16].astype(np.float64) @ k_t[:16].astype(np.float64))      # base 2: scores carry log₂ e
    np.testing.assert_allclose(l_i, p2.sum(1), rtol=1e-5)
    np.testing.assert_allclose(acc, p2 @ v, rtol=1e-4, atol=1e-4)


def test_the_mkl_provider_runs_the_compiled_loop_on_its_own_sgemm(rng, plain_calls):
    mkl = gemm.GEMM.mkl()
    if mkl is None:
        pytest.skip("the mkl extra is not installed: pip install 'qkv[mkl]'")
    saved = gemm.GEMM.choice
    q, k, v = _inputs(rng, L=900, S=900)
    try:
        outs = {}
        for name in ("numpy", "mkl"):
            gemm.set_gemm(name)
            for causal in (False, True):
                outs[name, causal] = tiled.forward(q, k, v, scale=0.2, is_causal=causal, threads=2)[0]
    finally:
        gemm.set_gemm(saved)
    assert "mkl" in plain_calls and "numpy" in plain_calls
    for causal in (False, True):
        np.testing.assert_allclose(outs["mkl", causal], outs["numpy", causal], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_compiled_loops_run_mkl_on_one_thread_per_worker(rng, monkeypatch, threads):
    """The loops call MKL's C sgemm themselves, so nothing else set this thread's MKL count before them: with
    MKL's own count at 2 its GEMMs ran on 2 threads in each worker (and with ``threads=1``). Each loop — the
    forward's, the lazy one, the backward's — now finds MKL at one thread on its thread."""
    import ctypes
    mkl = gemm.GEMM.mkl()
    if mkl is None:
        pytest.skip("the mkl extra is not installed: pip install 'qkv[mkl]'")
    get = mkl._lib.MKL_Get_Max_Threads
    get.restype = ctypes.c_int
    put = mkl._lib.MKL_Set_Num_Threads
    put.argtypes = [ctypes.c_int]
    seen = []

    class Probe:                                               # the kernels, each loop reading MKL's count first
        def __init__(self, jit):
            self.jit = jit

        def __getattr__(self, name):
            real = getattr(self.jit, name)
            return lambda *a: (seen.append((name, get())), real(*a))[1]
    for name, run in (("run_plain", kernels.run_plain), ("run_plain_lazy", kernels.run_plain_lazy),
                      ("run_plain_backward", kernels.run_plain_backward)):
        monkeypatch.setattr(kernels, name, lambda jit, g, *a, run=run: run(Probe(jit), g, *a))
    saved, before = gemm.GEMM.choice, get()
    put(2)                                                     # MKL's own count: 2, as on the 2-core test machine
    try:
        gemm.set_gemm("mkl")
        q, k, v = _inputs(rng, H=4, L=600, S=600)
        tiled.forward(q, k, v, scale=0.2, is_causal=True, threads=threads)                   # shift-free
        tiled.forward(q * 4, k * 4, v, scale=0.5, is_causal=True, threads=threads)           # lazy
        go = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(np.float32)
        tiled.backward(go, q, k, v, scale=0.2, is_causal=True, threads=threads)
    finally:
        gemm.set_gemm(saved)
        put(before)
    assert {n for n, _ in seen} == {"plain_rows", "plain_lazy_rows", "plain_backward_rows"}, seen
    assert all(n == 1 for _, n in seen), seen


# ---------------------------------------------------------------------------------------------- lazy blocks
@pytest.fixture
def lazy_calls(monkeypatch):
    """The forward's compiled loop for unbounded scores (lazy rescaling)."""
    return _spy(monkeypatch, "run_plain_lazy", kernels.run_plain_lazy)


LAZY = {
    "full": dict(amp=3.0),
    "causal": dict(amp=4.0, is_causal=True),
    "grouped-query causal (SmolLM2's shapes)": dict(H=9, Hk=3, L=512, S=512, E=64, amp=3.0, is_causal=True,
                                                    enable_gqa=True),
    "causal, more keys than queries": dict(L=300, S=1500, amp=5.0, is_causal=True),
    "odd sizes": dict(L=333, S=1025, E=40, Ev=17, amp=4.0),
    "split-K": dict(H=1, L=64, S=4096, amp=3.0),
    "sinks": dict(amp=3.0, is_causal=True, sinks=True),
    "values too large to be lazy (every block's max pass)": dict(amp=3.0, vamp=1e30),
    "a late key far above the running max (a lazy block redone)": dict(amp=3.0, late_key=True),
}


@needs_sgemm
@pytest.mark.parametrize("case", list(LAZY))
def test_the_compiled_lazy_loop_equals_the_python_loop_and_the_reference(rng, lazy_calls, plain_calls, monkeypatch,
                                                                         case):
    spec = dict(LAZY[case])
    amp, vamp = spec.pop("amp"), spec.pop("vamp", 1.0)
    late = spec.pop("late_key", False)
    q, k, v, threads, kw = _case(rng, spec)
    q, k, v = q * amp, k * amp, v * vamp
    if late:                # every query shares a direction u; the last key, 4u, scores ≈ 400 against ≈ 50:
        u = rng.standard_normal(q.shape[-1]).astype(np.float32)      # e^(s − m) would overflow, so its block
        u *= np.float32(np.sqrt(500 / (u @ u)))                       # must be redone with the max pass
        q += u
        k[..., -1, :] = 4 * u
    out, _, lse = tiled.forward(q, k, v, return_lse=True, threads=threads, **kw)
    assert lazy_calls and not plain_calls, "not the lazy loop (or the scores were bounded after all)"
    n = len(lazy_calls)
    with tiled.limits(plain_loop=False):
        base, _, base_lse = tiled.forward(q, k, v, return_lse=True, threads=threads, **kw)
    assert len(lazy_calls) == n
    # scores of ~100: the running max differs with the blocks (the diagonal's squares are smaller here), and
    # with it the rounding of exp(s − m) — as far apart as each is from float64
    np.testing.assert_allclose(out, base, rtol=2e-5, atol=2e-5 * vamp)
    np.testing.assert_allclose(lse, base_lse, rtol=1e-6, atol=2e-5)
    ref = _reference(q, k, v, **kw)
    # float32 scores of ~100 carry ~1e-5 of rounding into exp (as the Python loop's; see test_kernels)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=5e-5 * vamp)


# ---------------------------------------------------------------------------------------------- backward
@pytest.fixture
def plain_backward_calls(monkeypatch):
    """The backward's compiled loop's calls."""
    return _spy(monkeypatch, "run_plain_backward", kernels.run_plain_backward)


BACKWARD = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "causal, more queries than keys": dict(L=1100, S=600, is_causal=True),
    "causal, more keys than queries": dict(L=300, S=1500, is_causal=True),
    "causal, blocks that straddle the diagonal off-grid": dict(L=700, S=700, is_causal=True, block_q=300,
                                                               block_k=230),
    "odd sizes": dict(L=333, S=1025, E=40, Ev=17),
    "grouped-query causal": dict(H=6, Hk=2, is_causal=True, enable_gqa=True),
    "one thread": dict(is_causal=True, threads=1),
    "sinks": dict(is_causal=True, sinks=True),
}


@needs_sgemm
@pytest.mark.parametrize("case", list(BACKWARD))
def test_the_compiled_backward_equals_the_python_loop_and_float64(rng, plain_backward_calls, monkeypatch, case):
    q, k, v, threads, kw = _case(rng, BACKWARD[case])
    g = rng.standard_normal(q.shape[:3] + (v.shape[-1],)).astype(np.float32)
    got = tiled.backward(g, q, k, v, threads=threads, **kw)
    assert plain_backward_calls, "the backward did not take the compiled loop"
    n = len(plain_backward_calls)
    with tiled.limits(plain_loop=False):
        base = tiled.backward(g, q, k, v, threads=threads, **kw)
    assert len(plain_backward_calls) == n
    f = np.float64
    ref = tiled.backward(g.astype(f), q.astype(f), k.astype(f), v.astype(f), threads=threads, **kw)  # NumPy, f64
    for a, b, r in zip(got, base, ref):
        scale = np.abs(r).max()
        assert np.abs(a - r).max() <= 2e-6 * scale                        # as close to float64 as float32 gets
        assert np.abs(a - b).max() <= 2e-6 * scale                        # and to the Python loop's


@needs_sgemm
@pytest.mark.parametrize("case", ["a boolean mask", "softcap", "a block mask", "float64"])
def test_only_plain_backwards_take_the_compiled_loop(rng, plain_backward_calls, case):
    q, k, v = _inputs(rng)
    kw = dict(scale=0.2, threads=2)
    if case == "a boolean mask":
        kw["attn_mask"] = rng.random((700, 900)) > 0.3
    elif case == "softcap":
        kw["score_mod"] = mods.softcap(20.0)
    elif case == "a block mask":
        kw["block_mask"] = qkv.create_block_mask(mods.sliding_window(200), None, None, 700, 900)
    else:
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
    g = np.ones(q.shape[:3] + (v.shape[-1],), q.dtype)
    tiled.backward(g, q, k, v, **kw)
    assert plain_backward_calls == []


def _causal_cover(a, b, c, d, smallest):
    out = []
    tiled.plan._causal_split(a, b, c, d, smallest, out)
    cover = np.zeros((b - a, d - c), np.int64)
    computed = 0
    for r0, r1, c0, c1, off in out:
        assert a <= r0 < r1 <= b and c <= c0 < c1 <= d
        i, j = np.arange(r0, r1)[:, None], np.arange(c0, c1)[None, :]
        if off == kernels.NO_MASK:
            assert (j <= i).all()                                   # a whole block: every pair allowed
            allowed = np.ones((r1 - r0, c1 - c0), bool)
        else:
            assert off == r0 - c0 and max(r1 - r0, c1 - c0) <= smallest
            allowed = (j - c0) <= off + (i - r0)                    # the kernels' limit, c ≤ d + r
        cover[r0 - a:r1 - a, c0 - c:c1 - c] += allowed
        computed += (r1 - r0) * (c1 - c0)
    return cover, computed


@pytest.mark.parametrize("a,b,c,d", [(0, 512, 0, 512), (512, 1024, 512, 1024), (300, 600, 230, 460),
                                     (0, 97, 0, 1000), (1000, 1100, 0, 1024), (5, 6, 0, 9), (0, 512, 512, 1024)])
def test_causal_split_covers_the_causal_pairs_once(a, b, c, d):
    cover, computed = _causal_cover(a, b, c, d, 64)
    want = (np.arange(a, b)[:, None] >= np.arange(c, d)[None, :]).astype(np.int64)
    np.testing.assert_array_equal(cover, want)
    if (a, b, c, d) == (0, 512, 0, 512):                             # thrown away: 8 squares' upper halves
        assert computed - want.sum() == 8 * 64 * 63 // 2


@needs_sgemm
def test_gemm_share_times_the_compiled_backwards_gemms(plain_calls, plain_backward_calls):
    rows = bench.gemm_share(256, heads=1, dim=16, repeats=1, torch_sdpa=False, gemms=["numpy"],
                            modes=("backward",))
    assert plain_backward_calls and plain_calls
    (r,) = rows
    assert r["mode"] == "backward" and 0 < r["gemm_s"] < r["wall_s"]
    # the forward's two products and the backward's five, nothing thrown away: exactly the nominal flops
    assert r["gemm_gflops"] * r["gemm_s"] * 1e9 == pytest.approx(bench.flops("backward", 1, 1, 256, 16))
    with pytest.raises(ValueError, match="modes: expected some of forward, causal, backward, got 'sideways'"):
        bench.gemm_share(64, modes=("sideways",), torch_sdpa=False)


@needs_sgemm
def test_a_block_outside_the_buffers_is_refused_not_written(rng):
    # the loops hand raw pointers to the GEMM: a plan that does not fit its buffers must stop before it
    jit = kernels.KERNELS.jit()
    p = gemm.NumpyGemm()
    f = np.float32
    qs, k_t, v = np.zeros((64, 9), f), np.zeros((9, 128), f), np.zeros((128, 4), f)
    acc, l_i, sums, zeros = np.zeros((64, 4), f), np.zeros(64, f), np.zeros(64, f), np.zeros(64, f)
    for bad in ([0, 65, 0, 64, kernels.NO_MASK, 1], [0, 64, 64, 129, kernels.NO_MASK, 1],
                [0, 64, 0, 128, kernels.NO_MASK, 1]):                # rows, keys, the scores' scratch (64·64)
        with pytest.raises(ValueError, match="a block outside its buffers"):
            kernels.run_plain(jit, p, qs, k_t, v, np.array([bad], np.int64), np.zeros(64 * 64, f), acc, l_i, sums,
                              zeros, 1)
    q2, g2 = np.zeros((64, 8), f), np.zeros((64, 4), f)
    with pytest.raises(ValueError, match="a block outside its buffers"):
        kernels.run_plain_backward(jit, p, q2, g2, l_i, l_i, np.zeros((128, 8), f), k_t, v,
                                   np.array([[0, 64, 0, 100, kernels.NO_MASK]], np.int64), 0, 64,
                                   np.zeros(64 * 64, f), np.zeros(64 * 64, f), sums, np.zeros((64, 8), f), g2, q2)


def test_without_libcs_clock_the_python_loop_runs(rng, plain_calls, monkeypatch):
    # the loop needs libc's clock_gettime (for the share's timing); where ctypes cannot find it, no loop
    def no_libc(*a, **k):
        raise TypeError("CDLL(None): no process-wide symbol table here")
    monkeypatch.setattr(kernels, "_clock", lambda: no_libc())
    assert not kernels.plain_available(gemm.NumpyGemm())
    q, k, v = _inputs(rng)
    out = tiled.forward(q, k, v, scale=0.2, threads=2)[0]
    assert plain_calls == []
    np.testing.assert_allclose(out, _reference(q, k, v, scale=0.2), rtol=2e-5, atol=2e-6)


def test_a_block_after_bands_on_the_same_rows_adds_to_them(rng, monkeypatch):
    # the Python loop writes a shift-free block's P·V (instead of adding it) only where no earlier step
    # accumulated into its rows — batched bands included. After each band run of a sliding window, one more
    # step over the same rows whose cells are all empty: it adds nothing, and written instead of added it
    # would wipe the bands' sums (the planner emits no such step today; the bookkeeping must not rely on it)
    L = 2048
    q, k, v = (rng.standard_normal((1, 2, L, 32)).astype(np.float32) for _ in range(3))
    bm = qkv.create_block_mask(mods.sliding_window(64), None, None, L, L)
    real = tiled.forward_pass._band_groups
    runs = []

    def bands_then_empty(P, blocks, i0, slope, max_scores):
        steps = real(P, blocks, i0, slope, max_scores)
        extra = []
        for s in steps:
            if s[0] == "bands":                                     # ("bands", r0, nb, h, j0, w, pattern)
                for b in range(s[2]):
                    r0, r1 = s[1] + b * s[3], s[1] + (b + 1) * s[3]
                    extra.append((r0, r1, 0, s[3], ("grid", [(i0 + r0, i0 + r1, 0, s[3], -1)])))
        runs.extend(extra)
        return steps + extra
    monkeypatch.setattr(tiled.forward_pass, "_band_groups", bands_then_empty)
    with tiled.limits(tile_loop=False):                            # the bands (the compiled loop takes tiles)
        out = qkv.flex_attention(q, k, v, block_mask=bm)
    assert runs, "no band runs (the test would be vacuous)"
    f = np.float64
    ref = qkv.flex_attention(q.astype(f), k.astype(f), v.astype(f), block_mask=bm, backend="reference")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
