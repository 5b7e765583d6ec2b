"""The tests of tests/unit/test_backward.py that need torch or transformers."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.backends import tiled
from test_backward import _parallel_even_when_small  # noqa: E402,F401  (its helpers, shared)

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.parametrize("lead, L, S, E, mask, expected", [((1, 2), 16, 16, 8, "causal", "reference"),
                                                            ((2, 4), 64, 64, 16, "bool", "reference"),
                                                            ((1, 2), 512, 512, 8, "causal", "tiled"),
                                                            ((1, 1), 300, 1000, 8, None, "tiled")])
def test_small_problems_run_whole_and_large_ones_tiled(rng, monkeypatch, lead, L, S, E, mask, expected):
    # The public backward picks the reference backend up to BACKWARD_WHOLE_SCORES scores, the tiled engine
    # beyond (counted); either way the gradients are torch's.
    from qkv import backends
    used = []
    for name in ("reference", "tiled"):
        b = backends.get(name)
        monkeypatch.setattr(b, "backward", (lambda real, n: lambda *a, **kw: (used.append(n), real(*a, **kw))[1])(
            b.backward, name))
    q = rng.standard_normal(tuple(lead) + (L, E)).astype(np.float32)
    k, v = (rng.standard_normal(tuple(lead) + (S, E)).astype(np.float32) for _ in range(2))
    go = rng.standard_normal(tuple(lead) + (L, E)).astype(np.float32)
    m = rng.random((L, S)) < 0.7 if mask == "bool" else None
    with tiled.limits(backward_whole_scores=1 << 18):
        got = qkv.scaled_dot_product_attention_backward(go, q, k, v, attn_mask=m, is_causal=mask == "causal")
    assert used == [expected]
    for g, w in zip(got, _torch_grads(go, q, k, v, mask=m, is_causal=mask == "causal")):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


def _torch_grads(go, q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Autograd through torch's SDPA in float64."""
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)).double().requires_grad_() for a in (q, k, v))
    m = None if mask is None else torch.from_numpy(mask)
    m = m if m is None or m.dtype == torch.bool else m.double()
    kw = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=m, is_causal=is_causal, scale=scale, **kw)
    out.backward(torch.from_numpy(np.ascontiguousarray(go)).double())
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@st.composite
def configs(draw):
    hk = draw(st.sampled_from([1, 2]))
    gqa = draw(st.booleans())
    return dict(dtype=draw(st.sampled_from([np.float32, np.float64])),
                batch=draw(st.sampled_from([(), (2,)])), hk=hk, gqa=gqa,
                hq=hk * (draw(st.sampled_from([2, 3])) if gqa else 1),
                L=draw(st.integers(1, 30)), S=draw(st.integers(1, 30)),
                E=draw(st.sampled_from([1, 4, 8])), Ev=draw(st.sampled_from([3, 8])),
                mask=draw(st.sampled_from(["none", "causal", "bool", "bool_key", "float", "window"])),
                scale=draw(st.sampled_from([None, 0.7])),
                block_q=draw(st.integers(1, 8)), block_k=draw(st.integers(1, 8)),
                threads=draw(st.sampled_from([1, 2, 3])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=80)
@given(configs())
def test_gradients_match_torch_autograd(c):
    r = np.random.default_rng(c["seed"])
    lead = c["batch"] + (c["hq"],)
    dt = c["dtype"]
    q = r.standard_normal(lead + (c["L"], c["E"])).astype(dt)
    k = r.standard_normal(c["batch"] + (c["hk"], c["S"], c["E"])).astype(dt)
    v = r.standard_normal(c["batch"] + (c["hk"], c["S"], c["Ev"])).astype(dt)
    go = r.standard_normal(lead + (c["L"], c["Ev"])).astype(dt)
    mask, is_causal = None, c["mask"] == "causal"
    if c["mask"] == "bool":
        mask = r.random(lead + (c["L"], c["S"])) < 0.6
    elif c["mask"] == "bool_key":
        mask = r.random(c["batch"] + (1, 1, c["S"])) < 0.7
    elif c["mask"] == "window":
        mask = qkv.masks.sliding_window(c["L"], c["S"], window=3)
    elif c["mask"] == "float":
        mask = r.standard_normal((c["L"], c["S"])).astype(dt)
        mask[:, 1::2] = -np.inf
    if mask is not None:
        mask = np.array(mask)
        mask[..., 0] = True if mask.dtype == np.bool_ else 0.0    # no fully masked rows: torch gives NaN there
    kw = dict(mask=mask, is_causal=is_causal, scale=c["scale"], enable_gqa=c["gqa"])
    sc = 1 / math.sqrt(c["E"]) if c["scale"] is None else c["scale"]
    got = tiled.backward(go, q, k, v, attn_mask=mask, is_causal=is_causal, scale=sc, enable_gqa=c["gqa"],
                         block_q=c["block_q"], block_k=c["block_k"], threads=c["threads"])
    want = _torch_grads(go, q, k, v, **kw)
    tol = dict(atol=1e-4, rtol=1e-4) if dt == np.float32 else dict(atol=1e-10, rtol=1e-10)
    for name, g, w, a in zip("qkv", got, want, (q, k, v)):
        assert g.shape == a.shape and g.dtype == dt, name
        np.testing.assert_allclose(g, w, err_msg=f"grad_{name}", **tol)


def test_public_function_default_blocks_causal_gqa(rng):
    q = rng.standard_normal((1, 4, 300, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 300, 16)).astype(np.float32) for _ in range(2))
    go = rng.standard_normal((1, 4, 300, 16)).astype(np.float32)
    got = qkv.scaled_dot_product_attention_backward(go, q, k, v, is_causal=True, enable_gqa=True)
    want = _torch_grads(go, q, k, v, is_causal=True, enable_gqa=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_broadcast_key_gradients_are_summed(rng):
    q = rng.standard_normal((3, 2, 9, 4))
    k, v = (rng.standard_normal((1, 2, 11, 4)) for _ in range(2))
    go = rng.standard_normal((3, 2, 9, 4))
    got = qkv.scaled_dot_product_attention_backward(go, q, k, v)
    want = _torch_grads(go, q, k, v)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=1e-10)


def test_fully_masked_row_passes_no_gradient(rng):
    q, k, v, go = (rng.standard_normal((1, 6, 4)) for _ in range(4))
    mask = np.ones((6, 6), bool)
    mask[2] = False
    dq, dk, dv = qkv.scaled_dot_product_attention_backward(go, q, k, v, attn_mask=mask)
    assert np.all(dq[:, 2] == 0) and not np.any(np.isnan(dk)) and not np.any(np.isnan(dv))
    go2 = go.copy()
    go2[:, 2] = 0                                     # the dead row's output is 0 whatever its grad_out
    keep = np.ones((6, 6), bool)
    want = _torch_grads(go2, q, k, v, mask=np.where(mask, True, keep & (np.arange(6) == 0)))
    # with row 2 given one key and a zero grad_out, torch's grads of k, v equal ours
    np.testing.assert_allclose(dk, want[1], atol=1e-12)
    np.testing.assert_allclose(dv, want[2], atol=1e-12)


def test_float16_gradients(rng):
    q, k, v, go = (rng.standard_normal((2, 20, 8)).astype(np.float16) for _ in range(4))
    got = qkv.scaled_dot_product_attention_backward(go, q, k, v)
    want = _torch_grads(go, q, k, v)
    for g, w in zip(got, want):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float64), w, atol=1e-2, rtol=1e-2)


def test_gqa_with_batch_broadcast_keys(rng):
    q, go = (rng.standard_normal((2, 6, 40, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 50, 8)) for _ in range(2))
    got = qkv.scaled_dot_product_attention_backward(go, q, k, v, enable_gqa=True, is_causal=True)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    out = F.scaled_dot_product_attention(tq, tk.expand(2, 2, 50, 8), tv.expand(2, 2, 50, 8), enable_gqa=True,
                                         is_causal=True)
    out.backward(torch.from_numpy(go))
    for g, t in zip(got, (tq, tk, tv)):
        assert g.shape == tuple(t.shape)
        np.testing.assert_allclose(g, t.grad.numpy(), atol=1e-12)
