"""The tests of tests/unit/test_tiled.py that need torch or transformers."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv_tolerances import TOL
from qkv.backends import tiled
from test_tiled import _parallel_even_when_small, _ref, _tiled  # noqa: E402,F401  (its helpers, shared)

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _t(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def _torch64(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's SDPA in float64: the yardstick for every dtype."""
    m = None if mask is None else (_t(mask) if mask.dtype == np.bool_ else _t(mask).double())
    kw = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(_t(q).double(), _t(k).double(), _t(v).double(), attn_mask=m,
                                          is_causal=is_causal, scale=scale, **kw).numpy()


def _mask(kind, r, lead, L, S, dtype):
    if kind == "none":
        return None
    if kind == "bool_full":
        m = r.random(lead + (L, S)) < 0.6
    elif kind == "bool_row":
        m = r.random((L, S)) < 0.6
    elif kind == "bool_key":
        m = r.random(lead[:-1] + (1, 1, S)) < 0.7
    elif kind == "causal_br":
        m = qkv.masks.causal(L, S, align="bottom-right")
    elif kind == "window":
        m = qkv.masks.sliding_window(L, S, window=5)
    elif kind == "float":
        m = (r.standard_normal((1, L, S)) * 2).astype(dtype)
        m[..., ::3] = -np.inf
        m[..., 0] = 0.0
        return m
    else:
        raise AssertionError(kind)
    m = np.array(m)
    m[..., 0] = True                           # torch gives NaN on fully masked rows; tested on their own
    return m


@st.composite
def configs(draw):
    hk = draw(st.sampled_from([1, 2]))
    gqa = draw(st.booleans())
    return dict(
        dtype=draw(st.sampled_from([np.float16, np.float32, np.float64])),
        batch=draw(st.sampled_from([(), (2,)])),
        hk=hk, gqa=gqa, hq=hk * (draw(st.sampled_from([2, 3])) if gqa else 1),
        L=draw(st.integers(1, 40)), S=draw(st.integers(1, 40)),
        E=draw(st.sampled_from([1, 3, 8])), Ev=draw(st.sampled_from([2, 8])),
        mask=draw(st.sampled_from(["none", "bool_full", "bool_row", "bool_key", "causal", "causal_br",
                                   "window", "float"])),
        scale=draw(st.sampled_from([None, 0.5, 3.0])),
        block_q=draw(st.integers(1, 9)), block_k=draw(st.integers(1, 9)),
        threads=draw(st.sampled_from([1, 2, 3])),
        big=draw(st.booleans()),               # large scores: the online (running max) path
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=120)
@given(configs())
def test_tiled_matches_reference_and_torch(c):
    r = np.random.default_rng(c["seed"])
    lead = c["batch"] + (c["hq"],)
    amp = 6.0 if c["big"] else 1.0
    q = (r.standard_normal(lead + (c["L"], c["E"])) * amp).astype(c["dtype"])
    k = (r.standard_normal(c["batch"] + (c["hk"], c["S"], c["E"])) * amp).astype(c["dtype"])
    v = r.standard_normal(c["batch"] + (c["hk"], c["S"], c["Ev"])).astype(c["dtype"])
    is_causal = c["mask"] == "causal"
    mask = None if is_causal else _mask(c["mask"], r, lead, c["L"], c["S"], c["dtype"])
    kw = dict(is_causal=is_causal, scale=c["scale"], enable_gqa=c["gqa"])
    got, lse = _tiled(q, k, v, mask, block_q=c["block_q"], block_k=c["block_k"], threads=c["threads"], **kw)
    want_ref, want_lse = _ref(q, k, v, mask, return_lse=True, **kw)
    assert got.dtype == q.dtype and got.shape == want_ref.shape
    tol = TOL[c["dtype"]] if c["dtype"] != np.float32 else dict(atol=1e-5, rtol=1e-5)
    if c["big"]:                                  # scores up to ~100: float32 rounding of s is ~1e-5 relative
        tol = {np.float16: tol, np.float32: dict(atol=2e-4, rtol=2e-4), np.float64: tol}[c["dtype"]]
    np.testing.assert_allclose(got, want_ref, **tol)
    want = _torch64(q, k, v, mask, **kw)
    np.testing.assert_allclose(got.astype(np.float64), want, **{a: b * (3 if c["dtype"] == np.float16 else 1)
                                                                 for a, b in tol.items()})
    np.testing.assert_allclose(lse, want_lse, rtol=tol["rtol"], atol=tol["atol"] * 10)


@pytest.mark.parametrize("n", [63, 64, 65, 127, 128, 129])
@pytest.mark.parametrize("is_causal", [False, True])
def test_block_boundaries_plus_minus_one(n, is_causal, rng):
    q, k, v = (rng.standard_normal((2, n, 16)).astype(np.float32) for _ in range(3))
    want = _torch64(q, k, v, is_causal=is_causal)
    for bq, bk in [(64, 64), (32, 128), (128, 32)]:
        got, _ = _tiled(q, k, v, is_causal=is_causal, block_q=bq, block_k=bk)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_default_blocks_at_their_boundaries(rng):
    for L in (tiled.BLOCK_Q - 1, tiled.BLOCK_Q + 1):
        for S in (tiled.BLOCK_K - 1, tiled.BLOCK_K + 1):
            q = rng.standard_normal((1, L, 8)).astype(np.float32)
            k, v = (rng.standard_normal((1, S, 8)).astype(np.float32) for _ in range(2))
            got = qkv.scaled_dot_product_attention(q, k, v, backend="tiled")
            np.testing.assert_allclose(got, _torch64(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes(dtype, rng):
    q, k, v = (rng.standard_normal((2, 3, 37, 16)).astype(dtype) for _ in range(3))
    got = qkv.scaled_dot_product_attention(q, k, v, backend="tiled")
    assert got.dtype == dtype
    ref = qkv.scaled_dot_product_attention(q, k, v, backend="reference")
    np.testing.assert_allclose(got, ref, **TOL[dtype])
    np.testing.assert_allclose(got, _torch64(q, k, v), **{a: 2 * b for a, b in TOL[dtype].items()})


def test_lse_is_logsumexp_of_the_scaled_masked_scores(rng):
    q, k, v = (rng.standard_normal((3, 33, 8)) for _ in range(3))
    out, lse = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="tiled", return_lse=True)
    s = q @ k.transpose(0, 2, 1) / math.sqrt(8)
    s = np.where(np.tril(np.ones((33, 33), bool)), s, -np.inf)
    want = torch.logsumexp(torch.from_numpy(s), dim=-1).numpy()
    np.testing.assert_allclose(lse, want, atol=1e-12)


@pytest.mark.parametrize("L, S", [(300, 300), (300, 200), (200, 300), (257, 257)])
def test_causal_diagonal_split(L, S, rng):
    q = rng.standard_normal((2, L, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, S, 8)).astype(np.float32) for _ in range(2))
    for amp in (1.0, 8.0):                                   # shift-free and running-max paths
        with tiled.limits(diagonal_min=16):
            got, _ = _tiled(q * amp, k, v, is_causal=True, block_q=128, block_k=48)
        np.testing.assert_allclose(got, _torch64(q * amp, k, v, is_causal=True), atol=2e-5, rtol=2e-5)


def test_broadcast_leading_dims_and_strided_inputs(rng):
    q = rng.standard_normal((3, 1, 2, 17, 8))
    k = rng.standard_normal((4, 2, 19, 8))
    v = rng.standard_normal((4, 2, 8, 19)).swapaxes(-1, -2)          # a non-contiguous view
    got, _ = _tiled(q, k, v, block_q=5, block_k=4)
    np.testing.assert_allclose(got, _torch64(q, k, np.ascontiguousarray(v)), atol=1e-12)
    assert got.shape == (3, 4, 2, 17, 8)
