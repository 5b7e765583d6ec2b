"""The tests of tests/unit/test_sdpa.py that need torch or transformers."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv_tolerances import TOL

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _torch_sdpa(q, k, v, mask=None, **kw):
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))
    return F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask), **kw).numpy()


def _torch_weights(q, k, mask=None, is_causal=False, scale=None):
    """The weights torch's math path applies (softmax of the masked, scaled scores), in float64."""
    s = torch.from_numpy(q).double() @ torch.from_numpy(k).double().transpose(-1, -2)
    s = s * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        m = torch.from_numpy(mask)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    return torch.softmax(s, -1).numpy()


@st.composite
def configs(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    batch = draw(st.sampled_from([(), (1,), (2,), (2, 3)]))
    hk = draw(st.sampled_from([1, 2, 3]))
    gqa = draw(st.booleans())
    hq = hk * draw(st.sampled_from([1, 2, 4])) if gqa else hk
    L = draw(st.sampled_from([1, 2, 7, 16, 59, 113]))
    S = draw(st.sampled_from([1, 3, 7, 59, 64, 203]))
    E = draw(st.sampled_from([1, 4, 8, 59]))
    Ev = draw(st.sampled_from([E, 3, 16]))
    mask_kind = draw(st.sampled_from(["none", "bool_full", "bool_row", "bool_key", "float", "causal"]))
    scale = draw(st.sampled_from([None, None, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return dict(dtype=dtype, batch=batch, hq=hq, hk=hk, gqa=gqa, L=L, S=S, E=E, Ev=Ev, mask_kind=mask_kind,
                scale=scale, seed=seed)


def _make(c):
    r = np.random.default_rng(c["seed"])
    q = r.standard_normal(c["batch"] + (c["hq"], c["L"], c["E"])).astype(c["dtype"])
    k = r.standard_normal(c["batch"] + (c["hk"], c["S"], c["E"])).astype(c["dtype"])
    v = r.standard_normal(c["batch"] + (c["hk"], c["S"], c["Ev"])).astype(c["dtype"])
    L, S = c["L"], c["S"]
    mask, is_causal = None, False
    kind = c["mask_kind"]
    if kind == "bool_full":
        mask = r.random(c["batch"] + (c["hq"], L, S)) < 0.7
    elif kind == "bool_row":            # broadcast over batch and heads
        mask = r.random((L, S)) < 0.7
    elif kind == "bool_key":            # a key-padding mask, broadcast over heads and queries
        mask = r.random(c["batch"] + (1, 1, S)) < 0.8
    elif kind == "float":
        mask = r.standard_normal((1, L, S)).astype(c["dtype"])
        if S > 1:
            mask[..., -1] = -np.inf     # a float mask may remove keys with -inf
    elif kind == "causal":
        is_causal = True
    if mask is not None and mask.dtype == np.bool_:
        mask[..., 0] = True             # torch returns NaN on fully masked rows; compared separately
    return q, k, v, mask, is_causal


@settings(max_examples=200)
@given(configs())
def test_matches_torch(c):
    q, k, v, mask, is_causal = _make(c)
    kw = dict(is_causal=is_causal, scale=c["scale"], enable_gqa=c["gqa"])
    want = _torch_sdpa(q, k, v, mask, **kw)
    got, w = qkv.scaled_dot_product_attention(q, k, v, mask, return_weights=True, **kw)
    assert got.dtype == q.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL[c["dtype"]])
    n_rep = c["hq"] // c["hk"]
    kk = np.repeat(k, n_rep, axis=-3) if c["gqa"] else k
    want_w = _torch_weights(q, kk, mask, is_causal, c["scale"])
    np.testing.assert_allclose(w, want_w, **TOL[c["dtype"]])


@pytest.mark.parametrize("L,S", [(3, 5), (5, 3), (4, 4)])
def test_causal_is_top_left_like_torch(L, S, rng):
    q, k, v = (rng.standard_normal((2, L if i == 0 else S, 4)) for i in range(3))
    got, w = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_allclose(got, _torch_sdpa(q, k, v, is_causal=True), atol=1e-12)
    assert np.array_equal(w[0] > 0, np.tril(np.ones((L, S), bool)))


def test_float16_computes_in_float32_and_returns_float16(rng):
    q, k, v = (rng.standard_normal((2, 9, 8)).astype(np.float16) for _ in range(3))
    got = qkv.scaled_dot_product_attention(q, k, v)
    assert got.dtype == np.float16
    want = qkv.scaled_dot_product_attention(*(a.astype(np.float32) for a in (q, k, v)))
    np.testing.assert_array_equal(got, want.astype(np.float16))
    np.testing.assert_allclose(got, _torch_sdpa(q, k, v), **TOL[np.float16])


def test_fully_masked_row_is_zero_not_nan(rng):
    q, k, v = (rng.standard_normal((1, 3, 4)) for _ in range(3))
    mask = np.ones((3, 3), bool)
    mask[1] = False                                   # query 1 may attend to nothing
    out, w = qkv.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    assert np.all(out[:, 1] == 0) and np.all(w[:, 1] == 0)
    torch_out = _torch_sdpa(q, k, v, mask)
    # torch 2.13's SDPA math path also returns zeros here (older releases and nn.MultiheadAttention give NaN;
    # see test_mha.py); the naive formula gives NaN:
    np.testing.assert_allclose(out, torch_out, atol=1e-12)
    with np.errstate(invalid="ignore"):
        assert np.all(np.isnan(_torch_weights(q, k, mask)[:, 1]))
    fmask = np.where(mask, 0.0, -np.inf)              # the same with a float mask
    out_f = qkv.scaled_dot_product_attention(q, k, v, fmask)
    np.testing.assert_array_equal(out_f, out)
