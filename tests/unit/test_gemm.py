"""The GEMM provider (qkv.gemm): MKL equal to NumPy on every layout it is given, the choice and its errors,
the threads, and every path of the engine and the models run through the chosen provider with the same
results to rounding. The mkl tests skip when the extra is not installed (``pip install 'qkv[mkl]'``)."""
import ctypes
import threading

import numpy as np
import pytest

import qkv
from qkv import gemm, kernels
from qkv.backends.runtime import RUNTIME

HAS_MKL = gemm.GEMM.mkl() is not None
needs_mkl = pytest.mark.skipif(not HAS_MKL, reason="the mkl extra is not installed: pip install 'qkv[mkl]'")


@pytest.fixture
def restore_gemm():
    saved = gemm.GEMM.choice
    yield
    gemm.set_gemm(saved)


@pytest.fixture
def mkl():
    if not HAS_MKL:
        pytest.skip("the mkl extra is not installed: pip install 'qkv[mkl]'")
    return gemm.GEMM.provider("mkl")


def _f64(x):
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------------------------- layouts
def _views(rng, dt):
    """(a, b) pairs: every layout the engine passes (slices, transposed views, strided rows, vectors)."""
    A = rng.standard_normal((70, 90)).astype(dt)
    B = rng.standard_normal((90, 80)).astype(dt)
    return {
        "contiguous": (A[:33, :20].copy(), B[:20, :17].copy()),
        "row slices (lda > k)": (A[:33, :20], B[:20, :17]),
        "a transposed": (A[:20, :33].T, B[:20, :17]),
        "b transposed": (A[:33, :20], B[:17, :20].T),
        "both transposed": (A[:20, :33].T, B[:17, :20].T),
        "no unit stride (copied)": (A[::2, ::3], B[:30, ::3]),
        "negative strides (copied)": (A[::-1, :20], B[:20, ::-1]),
        "one row": (A[:1, :20], B[:20, :17]),
        "one column": (A[:33, :20], B[:20, 5:6]),
        "outer product": (A[:5, 3:4], B[7:8, :9]),
        "k = 0": (A[:5, :0], B[:0, :7]),
    }


@needs_mkl
@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(_views(np.random.default_rng(0), np.float32)))
def test_mkl_matmul_equals_numpy_on_every_layout(mkl, rng, dt, case):
    a, b = _views(rng, dt)[case]
    ref = _f64(a) @ _f64(b)
    tol = 1e-4 if dt == np.float32 else 1e-12
    got = mkl.matmul(a, b)
    assert got.dtype == dt and got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    # out= a slice of a wider array (ldc > n), and out= a transposed (column-major) view: written in place
    wide = np.full((a.shape[0], b.shape[1] + 3), 7, dt)
    assert mkl.matmul(a, b, out=wide[:, :b.shape[1]]) is not None
    np.testing.assert_allclose(wide[:, :b.shape[1]], ref, rtol=tol, atol=tol)
    assert np.all(wide[:, b.shape[1]:] == 7)                      # nothing beyond the view is touched
    col = np.empty((b.shape[1], a.shape[0]), dt).T
    assert mkl.matmul(a, b, out=col) is col
    np.testing.assert_allclose(col, ref, rtol=tol, atol=tol)


@needs_mkl
def test_mkl_writes_out_in_place_without_copying_a_view(mkl, rng, monkeypatch):
    """A transposed view is passed as a flag, not copied: np.ascontiguousarray is never called."""
    a = rng.standard_normal((64, 48), dtype=np.float32)
    b = rng.standard_normal((32, 48), dtype=np.float32)
    out = np.empty((64, 32), np.float32)
    calls = []
    real = np.ascontiguousarray
    monkeypatch.setattr(gemm.np, "ascontiguousarray", lambda *x, **k: calls.append(1) or real(*x, **k))
    got = mkl.matmul(a, b.T, out=out)
    assert got is out and not calls
    np.testing.assert_allclose(out, a @ b.T, rtol=1e-5, atol=1e-4)


@needs_mkl
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_mkl_matrix_vector_and_batches_equal_numpy(mkl, rng, dt):
    tol = 1e-4 if dt == np.float32 else 1e-12
    A = rng.standard_normal((40, 60)).astype(dt)
    x = rng.standard_normal(120).astype(dt)
    for a in (A[:30, :40], A[:40, :30].T, A[::2, ::2]):
        for v in (x[:a.shape[1]], x[:2 * a.shape[1]:2]):
            np.testing.assert_allclose(mkl.matmul(a, v), _f64(a) @ _f64(v), rtol=tol, atol=tol)
    y = np.empty(30, dt)
    assert mkl.matmul(A[:30, :40], x[:40], out=y) is y
    np.testing.assert_allclose(y, _f64(A[:30, :40]) @ _f64(x[:40]), rtol=tol, atol=tol)
    # batches, as the banded forward passes them: strided views of one array
    q = rng.standard_normal((4, 16, 8)).astype(dt)
    k = rng.standard_normal((8, 40)).astype(dt)
    kb = np.lib.stride_tricks.as_strided(k, shape=(4, 8, 20), strides=(5 * k.strides[1],) + k.strides)
    for a, b in ((q, kb), (q[:, ::2], np.swapaxes(kb, 1, 2).copy().swapaxes(1, 2)), (q, kb.copy())):
        np.testing.assert_allclose(mkl.matmul(a, b), _f64(a) @ _f64(b), rtol=tol, atol=tol)
    s = rng.standard_normal((3, 5, 7)).astype(dt)
    np.testing.assert_allclose(mkl.matmul(s, x[:7]), _f64(s) @ _f64(x[:7]), rtol=tol, atol=tol)
    # stacks with broadcast leading dimensions (attention_weights: (B, Hq, R, E) x (B, 1 or Hq, E, S))
    q4 = rng.standard_normal((2, 3, 5, 8)).astype(dt)
    k4 = rng.standard_normal((1, 3, 9, 8)).astype(dt)
    for b in (np.swapaxes(k4, -1, -2), np.swapaxes(k4[:, :1], -1, -2), k4[0, 0].T):
        np.testing.assert_allclose(mkl.matmul(q4, b), _f64(q4) @ _f64(b), rtol=tol, atol=tol)


@needs_mkl
def test_mkl_leaves_what_it_does_not_take_to_numpy(mkl, rng):
    """Other dtypes and mismatched shapes: exactly np.matmul (its results, its errors)."""
    i = rng.integers(-5, 5, (6, 7))
    assert np.array_equal(mkl.matmul(i, i.T), i @ i.T)
    h = rng.standard_normal((6, 7)).astype(np.float16)
    assert mkl.matmul(h, h.T).dtype == np.float16
    a = rng.standard_normal((2, 3, 6, 7), dtype=np.float32)
    b = rng.standard_normal((7, 5), dtype=np.float32)
    np.testing.assert_allclose(mkl.matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)
    mixed = mkl.matmul(a[0, 0], b.astype(np.float64))
    assert mixed.dtype == np.float64
    with pytest.raises(ValueError):
        mkl.matmul(a[0, 0], b.T)                                 # (6, 7) x (5, 7): np.matmul's own error
    with pytest.raises(ValueError, match="out: expected shape"):
        mkl.matmul(a[0, 0], b, out=np.empty((5, 6), np.float32))


@needs_mkl
def test_mkl_out_overlapping_an_operand_is_still_right(mkl, rng):
    a = rng.standard_normal((16, 16), dtype=np.float32)
    ref = a @ a
    got = mkl.matmul(a, a, out=a)                                 # BLAS cannot write over its input: a copy
    assert got is a
    np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-4)


@needs_mkl
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_mkl_exp_equals_numpy_to_rounding_with_numpys_special_values(mkl, rng, dt):
    x = (rng.standard_normal((300, 200)) * 20).astype(dt)
    x[0, :4] = [np.inf, -np.inf, np.nan, 1000]                  # inf, 0, nan, overflow to inf (no warning)
    with np.errstate(over="ignore"):
        ref = np.exp(x.astype(np.float64))
    with np.errstate(over="raise"):
        got = mkl.exp(x)
    assert got.dtype == dt
    rtol = 4e-7 if dt == np.float32 else 1e-15
    finite = np.isfinite(ref) & (ref < np.finfo(dt).max)
    np.testing.assert_allclose(got[finite], ref[finite].astype(dt), rtol=rtol)
    assert got[0, 0] == np.inf and got[0, 1] == 0 and np.isnan(got[0, 2]) and got[0, 3] == np.inf
    y = x.copy()
    assert mkl.exp(y, out=y) is y                               # in place, as the engine calls it
    np.testing.assert_array_equal(y, got)
    strided = x[:, ::2]                                          # not contiguous: NumPy's exp
    np.testing.assert_array_equal(mkl.exp(strided), np.exp(strided))


@needs_mkl
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_mkl_exp_leaves_underflowing_blocks_to_numpy(mkl, rng, dt, monkeypatch):
    # VML is several times slower than NumPy where results underflow (ALiBi's far keys, masked cells): a block
    # whose least value is below ln(smallest normal) goes to np.exp (bit-equal), the others to VML (counted).
    calls = []
    real = mkl._vexp[np.dtype(dt)]
    monkeypatch.setitem(mkl._vexp, np.dtype(dt), lambda *a: (calls.append(a[0]), real(*a)))
    fine = (-rng.random((64, 128)) * 80).astype(dt)                 # ≥ −80: every result a normal float
    mkl.exp(fine)
    assert calls == [fine.size]
    low = -90.0 if dt == np.float32 else -720.0
    for bad in (low, -np.inf, np.nan):
        x = fine.copy()
        x[5, 7] = bad
        got = mkl.exp(x.copy())
        np.testing.assert_array_equal(got, np.exp(x))
    assert calls == [fine.size]                                     # none of the three went to VML


# ---------------------------------------------------------------------------------------------- the choice
def test_set_gemm_rejects_bad_names_naming_the_argument(restore_gemm):
    with pytest.raises(ValueError, match=r"name: expected one of \('auto', 'numpy', 'mkl'\), got 'blis'"):
        qkv.set_gemm("blis")
    with pytest.raises(TypeError, match="name: expected a str"):
        qkv.set_gemm(None)


def test_without_the_extra_mkl_is_a_value_error_and_auto_is_numpy(monkeypatch):
    """A machine without the mkl wheel: asking for it says which extra to install; auto is NumPy, with no
    calibration."""
    monkeypatch.delenv("QKV_GEMM", raising=False)                 # the default choice, whatever the suite ran with
    monkeypatch.setattr(gemm, "_mkl_library_path", lambda: None)
    fresh = gemm.Gemm()
    monkeypatch.setattr(gemm, "GEMM", fresh)
    with pytest.raises(ValueError, match=r"pip install 'qkv\[mkl\]'"):
        qkv.set_gemm("mkl")
    assert fresh.choice == "auto"                               # a refused choice changes nothing
    assert qkv.get_gemm() == "numpy" and fresh.calibration is None
    assert fresh.available() == ("numpy",)
    a = np.ones((300, 300), np.float32)
    assert np.array_equal(gemm.matmul(a, a), a @ a)


@needs_mkl
def test_auto_that_took_mkl_keeps_small_products_on_numpy(monkeypatch):
    """Where ``auto`` takes MKL, products under AUTO_RESOLVE_FLOPS stay NumPy's (MKL's call costs more than
    they do): the explainer's numbers are NumPy's to the bit; larger ones go to MKL; ``mkl`` chosen sends all."""
    monkeypatch.delenv("QKV_GEMM", raising=False)
    fresh = gemm.Gemm()
    monkeypatch.setattr(gemm, "GEMM", fresh)
    mkl = fresh.mkl()
    calls = []
    real = mkl.matmul
    monkeypatch.setattr(mkl, "matmul", lambda a, b, out=None: (calls.append(a.shape), real(a, b, out=out))[1])
    fresh.calibration = {"chosen": "mkl", "exp": {"chosen": "numpy"}}   # what a Xeon's calibration chooses
    fresh.set("auto")
    assert qkv.get_gemm() == "mkl"
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 3))
    assert np.array_equal(gemm.matmul(x, w), x @ w) and calls == []
    t = qkv.Trace()
    from test_seeds import W_K, W_Q, W_V, X
    qkv.attention(X, W_Q, W_K, W_V, is_causal=True, trace=t)
    assert np.array_equal(t["Q"].array, X @ W_Q) and calls == []
    big = rng.standard_normal((256, 64), dtype=np.float32), rng.standard_normal((64, 512), dtype=np.float32)
    assert 256 * 64 * 512 >= gemm.AUTO_RESOLVE_FLOPS
    np.testing.assert_allclose(gemm.matmul(*big), big[0] @ big[1], rtol=1e-5, atol=1e-4)
    assert calls == [(256, 64)]
    fresh.set("mkl")                                                # asked for: every product
    gemm.matmul(x, w)
    assert calls == [(256, 64), (3, 4)]
    fresh.set("auto")                                               # the calibration kept: small ones NumPy's again
    gemm.matmul(x, w)
    assert calls == [(256, 64), (3, 4)] and qkv.get_gemm() == "mkl"


def test_qkv_gemm_environment_variable_sets_the_first_choice(monkeypatch):
    monkeypatch.setenv("QKV_GEMM", "numpy")
    assert gemm.Gemm().choice == "numpy"
    monkeypatch.setenv("QKV_GEMM", "blis")
    with pytest.warns(RuntimeWarning, match=r"QKV_GEMM: expected one of .* got 'blis'; using 'auto'"):
        assert gemm.Gemm().choice == "auto"
    monkeypatch.setenv("QKV_GEMM", "mkl")
    monkeypatch.setattr(gemm, "_mkl_library_path", lambda: None)
    with pytest.raises(ValueError, match=r"QKV_GEMM: 'mkl' needs Intel MKL.*pip install 'qkv\[mkl\]'"):
        gemm.Gemm().get()


def test_numpy_provider_is_np_matmul(restore_gemm, rng):
    qkv.set_gemm("numpy")
    assert qkv.get_gemm() == "numpy" and RUNTIME.get_gemm() == "numpy"
    a = rng.standard_normal((50, 40), dtype=np.float32)
    b = rng.standard_normal((40, 30), dtype=np.float32)
    assert np.array_equal(gemm.matmul(a, b), np.matmul(a, b))


@needs_mkl
def test_auto_calibrates_once_and_picks_by_time(restore_gemm, monkeypatch):
    monkeypatch.delenv("QKV_GEMM", raising=False)
    fresh = gemm.Gemm()
    monkeypatch.setattr(gemm, "GEMM", fresh)
    small = np.ones((8, 8), np.float32)
    gemm.matmul(small, small)                                    # too small to resolve auto: no calibration
    assert fresh.calibration is None
    name = qkv.get_gemm()
    cal = fresh.calibration
    assert name == cal["chosen"] and name in gemm.PROVIDERS
    assert fresh.exp_provider() == cal["exp"]["chosen"]             # exp is calibrated apart
    assert set(cal["exp"]["seconds"]) == {"numpy", "mkl"}
    assert set(cal["seconds"]) == {"numpy", "mkl"} and all(t > 0 for t in cal["seconds"].values())
    assert (name == "mkl") == (cal["seconds"]["mkl"] < (1 - gemm.AUTO_MARGIN) * cal["seconds"]["numpy"])
    qkv.set_gemm("numpy")
    qkv.set_gemm("auto")
    assert fresh.calibration is cal and qkv.get_gemm() == name  # once per process
    # the rule, on made-up times: MKL only when faster by more than the margin
    assert gemm._choose({"numpy": 1.0, "mkl": 0.9}) == "mkl"
    assert gemm._choose({"numpy": 1.0, "mkl": 0.97}) == "numpy"
    assert gemm._choose({"numpy": 1.0, "mkl": 1.5}) == "numpy"


@needs_mkl
def test_mkl_runs_on_one_thread_in_the_engines_workers_only(mkl, restore_gemm):
    """mkl_set_num_threads_local(1) in every worker and in an inline caller; MKL's own setting elsewhere."""
    lib = mkl._lib
    lib.MKL_Get_Max_Threads.restype = ctypes.c_int
    lib.MKL_Set_Num_Threads.argtypes = [ctypes.c_int]
    qkv.set_gemm("mkl")
    a = np.ones((64, 64), np.float32)
    gemm.matmul(a, a)                                            # outside the engine: this thread's own setting
    saved = lib.MKL_Get_Max_Threads()
    lib.MKL_Set_Num_Threads(2)
    own = lib.MKL_Get_Max_Threads()                              # MKL caps it at the cores it sees
    if own < 2:
        lib.MKL_Set_Num_Threads(saved)
        pytest.skip("MKL sees one core: one thread everywhere")
    try:
        seen = {}

        def task(i):
            gemm.matmul(a, a)
            seen[i] = (threading.current_thread().name, lib.MKL_Get_Max_Threads())
        RUNTIME.run([(i,) for i in range(4)], task, 2)           # on the workers
        assert {n for _, n in seen.values()} == {1}
        assert all(name.startswith(RUNTIME.WORKER_PREFIX) for name, _ in seen.values())
        seen.clear()
        RUNTIME.run([(0,)], task, 2)                             # one task: inline, on this thread
        assert seen[0][1] == 1
        gemm.matmul(a, a)                                        # outside the engine: MKL's own setting
        assert lib.MKL_Get_Max_Threads() == own
    finally:
        lib.MKL_Set_Num_Threads(saved)


# ---------------------------------------------------------------------------------------------- every path
@pytest.fixture
def counted_mkl(mkl, monkeypatch, restore_gemm):
    """MKL chosen, its matmul counted (so a path that bypasses the provider fails, not passes vacuously);
    its exp calls counted in ``calls.exps``."""
    calls = _Calls()
    real, real_exp = mkl.matmul, mkl.exp

    def counting(a, b, out=None):
        calls.append((np.shape(a), np.shape(b)))
        return real(a, b, out=out)

    def counting_exp(x, out=None):
        calls.exps.append(np.shape(x))
        return real_exp(x, out=out)
    monkeypatch.setattr(mkl, "matmul", counting)
    monkeypatch.setattr(mkl, "exp", counting_exp)
    for name in ("run_plain", "run_plain_lazy", "run_plain_backward"):   # the compiled loops call the provider's
        monkeypatch.setattr(kernels, name, _counting_loop(calls, mkl, getattr(kernels, name)))   # C sgemm
    return calls


def _counting_loop(calls, mkl, real):
    def loop(jit, gemm, *a):
        if gemm is mkl:
            calls.append(("compiled loop", mkl.name))
        return real(jit, gemm, *a)
    return loop


class _Calls(list):
    def __init__(self):
        super().__init__()
        self.exps = []


def _both(fn):
    """``fn()`` with NumPy's GEMM, then with MKL's; both results."""
    qkv.set_gemm("numpy")
    ref = fn()
    qkv.set_gemm("mkl")
    return ref, fn()


def _close(got, ref, dt=np.float32):
    tol = dict(rtol=2e-5, atol=2e-5) if dt == np.float32 else dict(rtol=1e-12, atol=1e-12)
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        np.testing.assert_allclose(g, r, **tol)


def _qkv(rng, L=300, S=300, H=2, Hk=2, E=16, dt=np.float32):
    return (rng.standard_normal((1, H, L, E)).astype(dt), rng.standard_normal((1, Hk, S, E)).astype(dt),
            rng.standard_normal((1, Hk, S, E)).astype(dt))


TILED = dict(backend="tiled", return_lse=True)
SMALL = dict(block_q=64, block_k=48)                              # many blocks, odd edges


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["full", "causal", "bool mask", "float mask", "gqa", "large scores"])
def test_tiled_forward_through_mkl_equals_numpy(counted_mkl, rng, dt, case):
    from qkv.backends import tiled
    q, k, v = _qkv(rng, L=260, S=300, H=4 if case == "gqa" else 2, Hk=2, dt=dt)
    kw = dict(scale=1 / 4, return_lse=True, **SMALL)
    if case == "causal":
        kw["is_causal"] = True
    elif case == "bool mask":
        kw["attn_mask"] = rng.random((260, 300)) > 0.3
    elif case == "float mask":
        kw["attn_mask"] = rng.standard_normal((260, 300)).astype(dt)
    elif case == "gqa":
        kw["enable_gqa"] = True
    elif case == "large scores":
        q = q * 8                                                  # lazy rescaling, not shift-free
    ref, got = _both(lambda: tiled.forward(q, k, v, **kw))
    assert counted_mkl, "the tiled forward did not call the GEMM provider"
    assert counted_mkl.exps, "the tiled forward's exps did not go through the provider"
    _close((got[0], got[2]), (ref[0], ref[2]), dt)
    expect = tiled.forward(q, k, v, **{**kw, "block_q": 1000, "block_k": 1000})
    _close(got[0], expect[0], dt)


def test_tiled_block_mask_bands_through_mkl_equal_numpy(counted_mkl, rng, numpy_kernels):
    """A sliding window runs in batched bands (3-D matmuls of strided views)."""
    from qkv import mods
    from qkv.backends import tiled
    from qkv.blockmask import create_block_mask
    q, k, v = _qkv(rng, L=1024, S=1024, E=16)
    bm = create_block_mask(mods.sliding_window(128), None, None, 1024, 1024, BLOCK_SIZE=64)
    ref, got = _both(lambda: tiled.forward(q, k, v, scale=0.25, block_mask=bm, return_lse=True))
    assert any(len(a) == 3 for a, _ in counted_mkl), "the bands did not go through the provider"
    assert any(len(x) == 3 for x in counted_mkl.exps)
    _close((got[0], got[2]), (ref[0], ref[2]))


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_backward_through_mkl_equals_numpy(counted_mkl, rng, dt, causal):
    from qkv.backends import tiled
    q, k, v = _qkv(rng, L=200, S=230, H=4, Hk=2, dt=dt)
    go = rng.standard_normal((1, 4, 200, 16)).astype(dt)
    kw = dict(scale=0.25, is_causal=causal, enable_gqa=True, block_q=64, block_k=48)
    ref, got = _both(lambda: tiled.backward(go, q, k, v, **kw))
    assert len(counted_mkl) > 20, "the tiled backward did not call the GEMM provider"
    assert counted_mkl.exps
    _close(got, ref, dt)


def test_public_sdpa_and_backward_with_mkl_equal_the_reference(counted_mkl, rng):
    q, k, v = _qkv(rng, L=512, S=512, H=4, Hk=4, E=32)
    qkv.set_gemm("mkl")
    out, lse = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, **TILED)
    ref = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference")
    assert counted_mkl
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    grads = qkv.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, is_causal=True)
    qkv.set_gemm("numpy")
    grads_np = qkv.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, is_causal=True)
    _close(grads, grads_np)


@pytest.mark.parametrize("case", ["plain", "causal gqa", "mask"])
def test_attention_weights_through_mkl_equal_numpy(counted_mkl, rng, case):
    q, k, _ = _qkv(rng, L=100, S=120, H=4 if case == "causal gqa" else 2, Hk=2)
    kw = {"plain": {}, "causal gqa": dict(is_causal=True, enable_gqa=True),
          "mask": dict(attn_mask=rng.random((100, 120)) > 0.5)}[case]
    ref, got = _both(lambda: qkv.attention_weights(q, k, rows=[0, 7, 99], **kw))
    assert counted_mkl
    _close(got, ref)


@needs_mkl
def test_mkl_thread_count_is_set_again_after_threadpoolctl_restored_it():
    """threadpoolctl (the runtime's BLAS limit) sets MKL's thread-local count too, and on leaving restores MKL's
    max (2 here) — a count qkv had remembered as 1 was then stale, and the compiled loops ran MKL on two threads
    with threads=1. Each call sets it now."""
    import ctypes
    threadpoolctl = pytest.importorskip("threadpoolctl")
    mkl = gemm.GEMM.provider("mkl")
    get = mkl._lib.MKL_Get_Max_Threads
    get.restype = ctypes.c_int
    put = mkl._lib.MKL_Set_Num_Threads
    put.argtypes = [ctypes.c_int]
    before = get()
    put(2)
    try:
        mkl._set_local(0)
        with threadpoolctl.threadpool_limits(1, user_api="blas"):   # remembers MKL's max, 2
            with gemm.single_threaded():
                mkl.before_c_calls()
                assert get() == 1
        assert get() == 2                                       # restored by threadpoolctl, behind qkv's back
        with gemm.single_threaded():
            mkl.before_c_calls()
            assert get() == 1
        mkl.before_c_calls()                                    # outside the engine: MKL's own count
        assert get() == 2
    finally:
        mkl._set_local(0)
        put(before)
