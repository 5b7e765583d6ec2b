"""The engine's runtime (qkv.backends.runtime.RUNTIME) under concurrent callers, and finite input that
would overflow the scores: computed in float64, or a ValueError — never NaN."""
import os
import threading

import numpy as np
import pytest

import qkv
from qkv.backends import tiled
from qkv.backends.runtime import RUNTIME

try:
    import threadpoolctl
except ImportError:  # pragma: no cover - the fast extra is not installed
    threadpoolctl = None

needs_threadpoolctl = pytest.mark.skipif(threadpoolctl is None, reason="needs threadpoolctl")


def _blas_threads():
    """BLAS's thread count as the process sees it now (the max over BLAS libraries; not MKL loaded as the GEMM
    provider, whose threads are set per thread: tests/unit/test_gemm.py)."""
    import os
    from qkv import gemm
    mkl = os.path.realpath(gemm.GEMM._mkl.path) if gemm.GEMM._mkl else None
    return max(i["num_threads"] for i in threadpoolctl.threadpool_info()
               if i["user_api"] == "blas" and os.path.realpath(i["filepath"]) != mkl)


def _wrap_tasks(monkeypatch, wrap):
    """Make every engine call run ``wrap(fn)`` instead of each task function ``fn`` (inside the call, on
    whichever thread runs the task)."""
    real = RUNTIME.run
    monkeypatch.setattr(RUNTIME, "run", lambda tasks, fn, threads: real(tasks, wrap(fn), threads))


@pytest.fixture
def blas_at_2():
    """BLAS at 2 threads for the test (whatever the machine's default), so that a leak to 1 shows."""
    if threadpoolctl is None:
        pytest.skip("needs threadpoolctl")
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        assert _blas_threads() == 2
        yield


# ---------------------------------------------------------------------------------------------- runtime
def test_concurrent_callers_with_mixed_thread_counts(monkeypatch):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 512, 32), dtype=np.float32) for _ in range(3))
    want = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", threads=1)
    before = _blas_threads() if threadpoolctl is not None else None
    on_workers = []

    def count(fn):
        def task(*a):
            if threading.current_thread().name.startswith("qkv-tiled"):
                on_workers.append(1)                              # list.append is atomic
            return fn(*a)
        return task

    _wrap_tasks(monkeypatch, count)
    n_callers, rounds = 8, 4
    barrier = threading.Barrier(n_callers, timeout=30)
    results, errors = {}, []

    def caller(i):
        try:
            for r in range(rounds):
                barrier.wait()                                    # every round starts together
                t = (i + r) % 3 + 1                               # 1, 2, 3 at the same time
                results[i, r] = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", threads=t)
        except BaseException as e:                                # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(n_callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == n_callers * rounds
    for got in results.values():
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert on_workers, "the calls should have run on the pool (tasks above SERIAL_BELOW_FLOPS)"
    if before is not None:
        assert _blas_threads() == before


def test_blas_setting_restored_after_overlapping_calls(monkeypatch, blas_at_2):
    """Call A enters, call B enters, A leaves, B leaves: BLAS is 1 while either runs, 2 after both."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 64, 8), dtype=np.float32) for _ in range(3))
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def hold(fn):
        def task(*a):
            name = threading.current_thread().name
            seen.setdefault(name, _blas_threads())
            if name == "A":
                a_in.set()
                assert b_in.wait(10)
            else:
                assert a_in.wait(10)
                b_in.set()
                assert a_done.wait(10)
            return fn(*a)
        return task

    _wrap_tasks(monkeypatch, hold)

    def call(name):
        qkv.scaled_dot_product_attention(q, k, v, backend="tiled", threads=1)
        if name == "A":
            seen["A left"] = _blas_threads()                     # B still inside
            a_done.set()

    ta, tb = (threading.Thread(target=call, args=(name,), name=name) for name in "AB")
    ta.start()
    tb.start()
    ta.join(20)
    tb.join(20)
    assert seen == {"A": 1, "B": 1, "A left": 1}
    assert _blas_threads() == 2


@needs_threadpoolctl
def test_counted_limit_survives_a_failing_task(blas_at_2):
    def boom(i):
        if i == 3:
            raise RuntimeError("task 3")

    with pytest.raises(RuntimeError, match="task 3"):
        RUNTIME.run([(i,) for i in range(8)], boom, 2)
    assert _blas_threads() == 2 and RUNTIME._blas_users == 0
    assert RUNTIME.blas_threads() == 2
    with RUNTIME.blas_single_threaded():
        assert _blas_threads() == 1
        assert RUNTIME.blas_threads() == 2                        # the setting outside, not the limit


def test_map_keeps_order_and_runs_on_the_workers():
    names = []

    def square(x):
        names.append(threading.current_thread().name)
        return x * x

    assert list(RUNTIME.map(square, range(10), 2)) == [x * x for x in range(10)]
    assert all(n.startswith("qkv-tiled") for n in names)
    names.clear()
    assert list(RUNTIME.map(square, range(3), 1)) == [0, 1, 4]          # one thread: inline
    assert names == [threading.current_thread().name] * 3


def test_thread_count_setting():
    old = RUNTIME.threads
    try:
        qkv.set_num_threads(3)
        assert qkv.get_num_threads() == tiled.get_num_threads() == RUNTIME.get_num_threads() == 3
        assert RUNTIME.resolve_threads(None) == 3 and RUNTIME.resolve_threads(2) == 2
    finally:
        qkv.set_num_threads(old)
    assert qkv.get_num_threads() == tiled.default_num_threads()
    with pytest.raises(ValueError, match="threads"):
        RUNTIME.resolve_threads(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_drops_the_pools_and_gets_blas_back(blas_at_2):
    import multiprocessing as mp
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 4, 512, 32), dtype=np.float32) for _ in range(3))
    want = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", threads=2)   # the parent's pool exists
    assert RUNTIME._pools
    ctx = mp.get_context("fork")
    with RUNTIME.blas_single_threaded():                          # forked while a caller holds BLAS at 1
        with ctx.Pool(1) as p:
            got, child_blas, child_pools = p.apply_async(_in_child, (q, k, v)).get(timeout=60)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert child_blas == 2                                        # the child has no caller holding it at 1
    assert child_pools == [2]                                     # only the pool it used itself
    assert _blas_threads() == 2


def _in_child(q, k, v):
    blas = _blas_threads()
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", threads=2)
    return out, blas, sorted(RUNTIME._pools)


# ---------------------------------------------------------------------------------------------- finite in, no NaN out
def _attention64(q, k, v, scale=None):
    """softmax(q·kᵀ·scale)·v by hand, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_float32_scores_beyond_float32_are_computed_in_float64(backend):
    rng = np.random.default_rng(3)
    v = rng.standard_normal((1, 2, 300, 8)).astype(np.float32)
    same = np.full((1, 2, 300, 8), 1e19, np.float32)             # every score 1.4e38: NaN before
    spread = (rng.standard_normal((1, 2, 300, 8)) * 1e19).astype(np.float32)
    for q, k in ((same, same), (spread, spread[:, :, ::-1]), (spread, -spread)):
        want = _attention64(q, k, v)
        out, lse = qkv.scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True)
        assert out.dtype == np.float32 and lse.dtype == np.float64       # lse beyond float32: kept wide
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        assert np.all(np.isfinite(lse))


def test_float64_scores_beyond_float64_raise():
    x = np.full((1, 1, 4, 2), 1e200)
    msg = r"query, key: the scores q·k·scale reach about 1\.4e\+400 .* over the 1e\+300 that float64"
    for backend in ("reference", "tiled"):
        with pytest.raises(ValueError, match=msg):
            qkv.scaled_dot_product_attention(x, x, x, backend=backend)
    with pytest.raises(ValueError, match=msg):
        qkv.scaled_dot_product_attention_backward(x, x, x, x)
    with pytest.raises(ValueError, match=msg):
        qkv.attention_weights(x, x, 0)
    small = np.ones((1, 1, 4, 2))                                # scale alone can overflow them too
    with pytest.raises(ValueError, match="scores"):
        qkv.scaled_dot_product_attention(small, small, small, scale=1e305)


def test_backward_and_weights_beyond_float32():
    rng = np.random.default_rng(4)
    q = (rng.standard_normal((1, 2, 64, 8)) * 1e19).astype(np.float32)
    k = (rng.standard_normal((1, 2, 64, 8)) * 1e19).astype(np.float32)
    v, go = (rng.standard_normal((1, 2, 64, 8)).astype(np.float32) for _ in range(2))
    got = qkv.scaled_dot_product_attention_backward(go, q, k, v)
    want = qkv.scaled_dot_product_attention_backward(*(x.astype(np.float64) for x in (go, q, k, v)))
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and np.all(np.isfinite(g))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())
    w = qkv.attention_weights(q, k, [0, 63])
    s = q[..., [0, 63], :].astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(w, p / p.sum(-1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("case", ["huge values", "float16 huge scale", "tiny", "mixed", "float64 near limit"])
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_extreme_finite_inputs_give_no_nan(case, backend):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 200, 16)) for _ in range(3))
    dtype, scale = np.float32, None
    if case == "huge values":                                    # the tiled engine's sums of p·v overflowed
        v = v / np.abs(v).max() * 3e38
    elif case == "float16 huge scale":
        dtype, scale = np.float16, 1e34
    elif case == "tiny":
        q, k, v = q * 1e-30, k * 1e-30, v * 1e-35                  # scores underflow to 0: uniform
    elif case == "mixed":
        q, k = q * 1e30, k * 1e-30
    else:
        dtype = np.float64
        q, k = q * 1e145, k * 1e145
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out = qkv.scaled_dot_product_attention(q, k, v, scale=scale, backend=backend)
    assert out.dtype == dtype and np.all(np.isfinite(out))
    want = _attention64(q, k, v, scale)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=1e-2 if dtype == np.float16 else 1e-5,
                               atol=1e-6 * np.abs(want).max())


def test_the_runtime_owns_the_engine_state_kernels_gemm_and_caches():
    """The kernel choice, the GEMM provider and the caches are the runtime's: the tiled engine asks it."""
    from qkv import gemm, kernels
    from qkv.backends import runtime
    from qkv.backends.tiled import plan

    R = runtime.RUNTIME
    assert R.kernels is kernels.KERNELS and R.gemm is gemm.GEMM
    saved = R.kernels.choice
    try:
        R.set_kernels("numpy")
        assert R.get_kernels() == "numpy" == kernels.get_kernels()
    finally:
        R.kernels.choice = saved
    bm = qkv.create_block_mask(qkv.mods.sliding_window(16), None, None, 256, 256, BLOCK_SIZE=32)
    q = np.random.default_rng(0).standard_normal((1, 2, 256, 32)).astype(np.float32)
    before = len(R.plans(bm))
    qkv.flex_attention(q, q, q, block_mask=bm, backend="tiled")
    assert len(R.plans(bm)) > before                      # the plans of this block mask, kept by the runtime
    assert plan.RUNTIME is R


def test_bounded_cache_is_thread_safe_and_keeps_its_budget():
    from concurrent.futures import ThreadPoolExecutor

    from qkv.backends.runtime import BoundedCache

    cache = BoundedCache(budget=10 * 800)                 # ten arrays of 100 float64
    built = []

    def build(i):
        built.append(i)
        return (np.full(100, float(i)),)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: cache.get(i % 25, lambda: build(i % 25))[0][0], range(400)))
    assert got == [float(i % 25) for i in range(400)]     # every key gives its own value
    assert len(cache) <= 10 and cache._bytes <= cache.budget
    cache.drop(next(iter(cache._items)))
    assert cache._bytes == sum(v[0].nbytes for v in cache._items.values())
