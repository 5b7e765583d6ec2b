"""The compiled loop of a task under ALiBi, a softcap or both (qkv.compute._jit_mods.mod_rows through
qkv.kernels.run_mods): each of its branches — the softcap's polynomial and tanh, ALiBi's bias beside the
diagonal (row term in the product, column term added) and across it, the two composed — held to the float64
engine and to the Python loop it replaces (tiled.limits(plain_loop=False)), and where it must not run."""
import math

import numpy as np
import pytest

from qkv import gemm, kernels, mods, paths
from qkv.backends import tiled

pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(gemm.NumpyGemm().c_sgemm is None, reason="no CBLAS sgemm qkv can find")


@pytest.fixture
def mod_calls(monkeypatch):
    """The mod loop's calls: ``(kind, slope is not NaN, first query position)`` of each."""
    calls, real = [], kernels.run_mods
    monkeypatch.setattr(kernels, "run_mods", lambda jit, g, *a: (calls.append((a[10], not math.isnan(a[13]), a[9])),
                                                                  real(jit, g, *a)))
    monkeypatch.setattr(kernels.KERNELS, "choice", "auto")
    return calls


def _inputs(rng, H, L, S, E, amp=1.0):
    q = (rng.standard_normal((1, H, L, E)) * amp).astype(np.float32)
    k = (rng.standard_normal((1, H, S, E)) * amp).astype(np.float32)
    v = rng.standard_normal((1, H, S, E)).astype(np.float32)
    return q, k, v


MODS = {
    "alibi": lambda H: mods.alibi(mods.alibi_slopes(H)),
    "softcap 20": lambda H: mods.softcap(20.0),                  # the fitted polynomial (kind 1)
    "softcap 1": lambda H: mods.softcap(1.0),                    # tanh (kind 2)
    "alibi, softcap": lambda H: mods.compose(mods.alibi(mods.alibi_slopes(H)), mods.softcap(5.0)),
    "alibi < 0, softcap": lambda H: mods.compose(mods.alibi(-mods.alibi_slopes(H)), mods.softcap(5.0)),
}


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("threads", [1, 2])
def test_the_mod_loop_equals_float64_and_the_python_loop(name, threads, mod_calls):
    rng = np.random.default_rng(len(name) + threads)
    H, L, E = 3, 300, 16
    q, k, v = _inputs(rng, H, L, L, E)
    mod, causal = MODS[name](H), name.startswith("alibi") or threads == 2
    kw = dict(scale=E ** -0.5, is_causal=causal, score_mod=mod, return_lse=True, threads=threads)
    with paths.counting() as seen, tiled.limits(block_q_plain=128, kernel_min=0):     # tasks past row 0
        out, _, lse = tiled.forward(q, k, v, **kw)
    with tiled.limits(plain_loop=False):
        py_out, _, py_lse = tiled.forward(q, k, v, **kw)
    ref, _, ref_lse = tiled.forward(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    assert seen["forward.mod_loop"] == len(mod_calls) > H and seen["forward.shift_free"] == 0
    kind = 1 if name == "softcap 20" else 2 if "softcap" in name else 0
    assert {c[0] for c in mod_calls} == {kind} and all(c[1] == name.startswith("alibi") for c in mod_calls)
    assert max(c[2] for c in mod_calls) > 0
    err, py_err = np.abs(out - ref).max(), np.abs(py_out - ref).max()
    assert err <= max(2 * py_err, 2e-6), (err, py_err)
    np.testing.assert_allclose(lse, ref_lse, atol=3e-5 * max(1.0, np.abs(ref_lse).max()))


def test_alibi_rounds_its_bias_as_the_python_loop_beside_and_across_the_diagonal(mod_calls):
    """A steep slope on long rows: the bias reaches −1000s, far keys underflow to 0 (the clamped 2^x), and the
    column terms of blocks far from the diagonal stay as exact as the bias itself."""
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 2, 2048, 2048, 32)
    mod = mods.alibi(np.array([0.5, 1 / 256]))
    kw = dict(scale=32 ** -0.5, is_causal=True, score_mod=mod)
    out = tiled.forward(q, k, v, **kw)[0]
    ref = tiled.forward(*(a.astype(np.float64) for a in (q, k, v)), **kw)[0]
    assert mod_calls and np.abs(out - ref).max() < 3e-6
    assert np.isfinite(out).all()


@pytest.mark.parametrize("case", ["alibi, not causal", "large scores", "weights", "mask", "float64", "dropout"])
def test_the_mod_loop_runs_only_where_it_is_exact(case, mod_calls):
    """ALiBi without the causal mask (scores unbounded above), large scores, weights asked for, a mask, float64
    and dropout: the Python loop's strategies, as before."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 2, 200, 200, 16, amp=4.0 if case == "large scores" else 1.0)
    mod = mods.alibi(mods.alibi_slopes(2)) if case != "weights" else mods.softcap(20.0)
    kw = dict(scale=0.25, is_causal=case != "alibi, not causal", score_mod=mod)
    if case == "weights":
        kw["return_weights"] = True
    if case == "mask":
        kw["attn_mask"], kw["is_causal"] = np.tril(np.ones((200, 200), bool)), False
    if case == "float64":
        q, k, v = (a.astype(np.float64) for a in (q, k, v))
    if case == "dropout":
        kw["dropout_p"], kw["rng"] = 0.1, np.random.default_rng(0)
    tiled.forward(q, k, v, **kw)
    assert not mod_calls


def test_the_mod_loop_runs_on_mkls_sgemm_too(monkeypatch):
    """The loop's products by the GEMM provider's own C sgemm: MKL's, held to float64 as NumPy's OpenBLAS is."""
    mkl = gemm.GEMM.mkl()
    if mkl is None:
        pytest.skip("the mkl extra is not installed: pip install 'qkv[mkl]'")
    providers, real = [], kernels.run_mods
    monkeypatch.setattr(kernels, "run_mods", lambda jit, g, *a: (providers.append(g.name), real(jit, g, *a)))
    monkeypatch.setattr(kernels.KERNELS, "choice", "auto")
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, 3, 400, 400, 32)
    saved = gemm.GEMM.choice
    try:
        for name in ("alibi", "alibi, softcap"):
            kw = dict(scale=32 ** -0.5, is_causal=True, score_mod=MODS[name](3), threads=2)
            ref = tiled.forward(*(a.astype(np.float64) for a in (q, k, v)), **kw)[0]
            for provider in ("numpy", "mkl"):
                gemm.set_gemm(provider)
                out = tiled.forward(q, k, v, **kw)[0]
                assert np.abs(out - ref).max() < 3e-6, (name, provider)
    finally:
        gemm.set_gemm(saved)
    assert "mkl" in providers and "numpy" in providers
