"""The tests of tests/unit/test_mha.py that need torch or transformers."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv_tolerances import TOL

torch = pytest.importorskip("torch")


@st.composite
def mha_configs(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    return dict(
        heads=heads,
        D=heads * draw(st.sampled_from([1, 4, 7])),
        cross=draw(st.booleans()),
        kdim=draw(st.sampled_from([None, 5, 11])),
        vdim=draw(st.sampled_from([None, 3, 9])),
        bias=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        B=draw(st.sampled_from([1, 2, 3])),
        L=draw(st.sampled_from([1, 4, 7, 13])),
        S=draw(st.sampled_from([1, 5, 7, 16])),
        key_mask=draw(st.booleans()),
        attn_mask=draw(st.sampled_from(["none", "bool", "float", "bool3d"])),
        average=draw(st.booleans()),
        dtype=draw(st.sampled_from([np.float32, np.float64])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@settings(max_examples=120)
@given(mha_configs())
def test_matches_torch_multihead_attention(c):
    torch.manual_seed(c["seed"])
    tdtype = torch.float32 if c["dtype"] == np.float32 else torch.float64
    kdim, vdim = (c["kdim"], c["vdim"]) if c["cross"] else (None, None)
    m = torch.nn.MultiheadAttention(c["D"], c["heads"], bias=c["bias"], kdim=kdim, vdim=vdim,
                                    batch_first=c["batch_first"], dtype=tdtype).eval()
    if c["bias"]:   # torch initializes biases to zero; make them count
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    ours = qkv.MultiHeadAttention.from_torch(m)
    r = np.random.default_rng(c["seed"])
    B, L, S = c["B"], c["L"], c["S"]
    S_eff = S if c["cross"] else L

    def seq(T, width):
        x = r.standard_normal((B, T, width)).astype(c["dtype"])
        return x if c["batch_first"] else x.transpose(1, 0, 2).copy()

    x = seq(L, c["D"])
    if c["cross"]:
        k, v = seq(S, m.kdim), seq(S, m.vdim)
    else:
        k = v = x
    real = r.random((B, S_eff)) < 0.75
    real[:, 0] = True                       # torch's MHA returns NaN for a query that sees no key
    key_mask = real if c["key_mask"] else None
    attn = None
    if c["attn_mask"] == "bool":
        attn = r.random((L, S_eff)) < 0.7
        attn[:, 0] = True
    elif c["attn_mask"] == "bool3d":
        attn = r.random((B * c["heads"], L, S_eff)) < 0.7
        attn[..., 0] = True
    elif c["attn_mask"] == "float":
        attn = r.standard_normal((L, S_eff)).astype(c["dtype"])
    T = torch.from_numpy
    # torch's masks mean True = blocked: convert once, here
    t_kpm = None if key_mask is None else T(~key_mask)
    t_attn = None if attn is None else (T(~attn) if attn.dtype == np.bool_ else T(attn))
    with torch.no_grad():
        want, want_w = m(T(x), T(k), T(v), key_padding_mask=t_kpm, attn_mask=t_attn, need_weights=True,
                         average_attn_weights=c["average"])
    got, got_w = ours(x, None if not c["cross"] else k, None if not c["cross"] else v, key_mask=key_mask,
                      attn_mask=attn, need_weights=True, average_attn_weights=c["average"])
    tol = dict(TOL[c["dtype"]])
    tol["atol"] *= 5
    np.testing.assert_allclose(got, want.numpy(), **tol)
    np.testing.assert_allclose(got_w, want_w.numpy(), **tol)
    assert got.dtype == c["dtype"]


def test_unbatched_input_and_default_key_value(rng):
    m = torch.nn.MultiheadAttention(8, 2).eval()
    ours = qkv.MultiHeadAttention.from_torch(m)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    with torch.no_grad():
        want, want_w = m(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x))
    got, got_w = ours(x, need_weights=True)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
    np.testing.assert_allclose(got_w, want_w.numpy(), atol=1e-6)
    assert ours(x)[1] is None


def _gqa_reference(m: qkv.MultiHeadAttention, x, mask=None):
    """Grouped-query attention computed by torch SDPA (enable_gqa) with qkv's weights."""
    T = lambda a: torch.from_numpy(np.ascontiguousarray(a)).double()
    B, L, _ = x.shape
    H, Hk, E = m.num_heads, m.num_kv_heads, m.head_dim
    q = (T(x) @ T(m.W_Q) + T(m.b_Q)).view(B, L, H, E).transpose(1, 2)
    k = (T(x) @ T(m.W_K) + T(m.b_K)).view(B, L, Hk, E).transpose(1, 2)
    v = (T(x) @ T(m.W_V) + T(m.b_V)).view(B, L, Hk, E).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else torch.from_numpy(mask), enable_gqa=True)
    return (o.transpose(1, 2).reshape(B, L, H * E) @ T(m.W_O) + T(m.b_O)).numpy()


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 3), (4, 1), (8, 8)])
def test_grouped_and_multi_query(heads, kv_heads, rng):
    m = qkv.MultiHeadAttention(heads * 4, heads, num_kv_heads=kv_heads, dtype=np.float64, seed=1)
    m.load(b_Q=rng.standard_normal(m.b_Q.shape), b_K=rng.standard_normal(m.b_K.shape),
           b_V=rng.standard_normal(m.b_V.shape), b_O=rng.standard_normal(m.b_O.shape))
    assert m.W_K.shape == (heads * 4, kv_heads * 4)
    x = rng.standard_normal((2, 7, heads * 4))
    key_mask = np.array([[True] * 7, [True] * 4 + [False] * 3])
    got, _ = m(x, key_mask=key_mask)
    want = _gqa_reference(m, x, key_mask[:, None, None, :])
    np.testing.assert_allclose(got, want, atol=1e-10)


def test_fully_masked_query_gives_zero_attention_not_nan(rng):
    m = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    ours = qkv.MultiHeadAttention.from_torch(m)
    x = rng.standard_normal((1, 3, 4)).astype(np.float32)
    allowed = np.ones((3, 3), bool)
    allowed[1] = False
    with torch.no_grad():
        want = m(*(torch.from_numpy(x),) * 3, attn_mask=torch.from_numpy(~allowed))[0].numpy()
    got, w = ours(x, attn_mask=allowed, need_weights=True)
    assert np.all(np.isnan(want[0, 1]))                   # torch's MultiheadAttention: NaN
    np.testing.assert_allclose(got[0, 1], ours.b_O, atol=0)  # qkv: zero attention, so only the output bias
    assert np.all(w[0, 1] == 0)
    np.testing.assert_allclose(got[0, [0, 2]], want[0, [0, 2]], atol=1e-5)


def test_from_torch_separate_projections_no_bias():
    m = torch.nn.MultiheadAttention(6, 2, kdim=4, vdim=5, bias=False, batch_first=True).eval()
    ours = qkv.MultiHeadAttention.from_torch(m)
    assert ours.b_Q is None and ours.W_K.shape == (4, 6) and ours.W_V.shape == (5, 6)
    np.testing.assert_array_equal(ours.W_Q, m.q_proj_weight.detach().numpy().T)
