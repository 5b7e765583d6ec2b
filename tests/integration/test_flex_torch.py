"""The tests of tests/unit/test_flex.py that need torch or transformers."""
import math
import warnings

import numpy as np
import pytest

import qkv
from qkv import mods
from qkv.backends import tiled
from test_flex import BACKENDS, _qkv  # noqa: E402,F401  (its helpers, shared)

torch = pytest.importorskip("torch")
from torch.nn.attention.flex_attention import create_block_mask as t_create_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as t_flex_attention  # noqa: E402

B, H = 2, 4
SIZES = [(1, 1, 128), (7, 7, 16), (59, 59, 16), (130, 130, 128), (257, 257, 128), (59, 130, 16), (130, 59, 16)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param != "tiled":
        yield request.param
        return
    if "score_mod" not in qkv.backends.get("tiled").features:
        pytest.skip("the tiled engine does not compute score_mod/block_mask/sinks yet (TiledBackend.features)")
    # small, odd tiles that do not line up with the block masks' BLOCK_SIZE: every boundary case occurs
    with tiled.limits(block_q=48, block_k=40, block_q_backward=40, block_k_backward=48):
        yield request.param


# ================================================================================== the cases, both sides
class Case:
    """One variant: the qkv mods and the torch mods they stand for."""

    def __init__(self, mask=None, t_mask=None, score=None, t_score=None, sinks=False, gqa=False, per_batch=False):
        self.mask, self.t_mask, self.score, self.t_score = mask, t_mask, score, t_score
        self.sinks, self.gqa, self.per_batch = sinks, gqa, per_batch


def _doc_ids(n, seed, rows=None):
    r = np.random.default_rng(seed)
    shape = (n,) if rows is None else (rows, n)
    return np.sort(r.integers(0, max(1, n // 9), shape), axis=-1)


def make_case(name: str, L: int, S: int) -> Case:
    n = max(L, S)
    slopes = mods.alibi_slopes(H)
    t_slopes = torch.from_numpy(slopes)
    causal_t = lambda b, h, q, kv: q >= kv                                          # noqa: E731
    if name == "none":
        return Case()
    if name == "causal":
        return Case(mods.causal(), causal_t)
    if name == "sliding_window":
        return Case(mods.sliding_window(5), lambda b, h, q, kv: (q >= kv) & (q - kv < 5))
    if name == "prefix_lm":
        return Case(mods.prefix_lm(4), lambda b, h, q, kv: (kv < 4) | (q >= kv))
    if name == "document":
        ids = _doc_ids(n, 1)
        t_ids = torch.from_numpy(ids)
        return Case(mods.document(ids), lambda b, h, q, kv: t_ids[q] == t_ids[kv])
    if name == "document_2d":
        ids = _doc_ids(n, 2, rows=B)
        t_ids = torch.from_numpy(ids)
        return Case(mods.and_masks(mods.causal(), mods.document(ids)),
                    lambda b, h, q, kv: (q >= kv) & (t_ids[b, q] == t_ids[b, kv]), per_batch=True)
    if name == "streaming":
        return Case(mods.or_masks(mods.sinks(4), mods.sliding_window(8)),
                    lambda b, h, q, kv: (kv < 4) | ((q >= kv) & (q - kv < 8)))
    if name == "alibi":
        return Case(score=mods.alibi(slopes), t_score=lambda s, b, h, q, kv: s + t_slopes[h] * (kv - q))
    if name == "softcap":
        return Case(score=mods.softcap(1.0), t_score=lambda s, b, h, q, kv: 1.0 * torch.tanh(s / 1.0))
    if name == "compose":
        return Case(mods.causal(), causal_t, mods.compose(mods.alibi(slopes), mods.softcap(2.0)),
                    lambda s, b, h, q, kv: 2.0 * torch.tanh((s + t_slopes[h] * (kv - q)) / 2.0))

    if name == "custom_where":
        def where_mod(score, b, h, q_idx, kv_idx):
            return np.where(kv_idx > q_idx, score * 0.5, score + 0.1 * h)

        def where_grad(score, b, h, q_idx, kv_idx):
            return np.where(kv_idx > q_idx, 0.5, 1.0)
        return Case(score=mods.ScoreMod(where_mod, grad=where_grad),
                    t_score=lambda s, b, h, q, kv: torch.where(kv > q, s * 0.5, s + 0.1 * h.to(s.dtype)))
    if name == "gqa":
        return Case(mods.causal(), causal_t, gqa=True)
    if name == "sinks":
        return Case(sinks=True)
    if name == "sinks_window":
        return Case(mods.sliding_window(6), lambda b, h, q, kv: (q >= kv) & (q - kv < 6), sinks=True)
    if name == "empty_rows":                      # rows 3, 8, 13, … may attend to nothing
        return Case(mods.and_masks(mods.causal(), lambda b, h, q, kv: q % 5 != 3),
                    lambda b, h, q, kv: (q >= kv) & (q % 5 != 3))
    if name == "empty_rows_sinks":
        return Case(mods.and_masks(mods.causal(), lambda b, h, q, kv: q % 5 != 3),
                    lambda b, h, q, kv: (q >= kv) & (q % 5 != 3), sinks=True)
    raise KeyError(name)


CASES = ["none", "causal", "sliding_window", "prefix_lm", "document", "document_2d", "streaming", "alibi",
         "softcap", "compose", "custom_where", "gqa", "sinks", "sinks_window", "empty_rows", "empty_rows_sinks"]


def inputs(case: Case, L, S, dtype, seed=0, E=16, Ev=12):
    r = np.random.default_rng(seed)
    hk = 2 if case.gqa else H
    q = r.standard_normal((B, H, L, E)).astype(dtype)
    k = r.standard_normal((B, hk, S, E)).astype(dtype)
    v = r.standard_normal((B, hk, S, Ev)).astype(dtype)
    go = r.standard_normal((B, H, L, Ev)).astype(dtype)
    sink = (r.standard_normal(H) * 2).astype(dtype) if case.sinks else None
    return q, k, v, go, sink


def qkv_block_mask(case: Case, L, S, bs):
    if case.mask is None:
        return None
    return qkv.create_block_mask(case.mask, B if case.per_batch else None, None, L, S, BLOCK_SIZE=bs)


def torch_flex(case: Case, q, k, v, L, S, bs):
    """torch's flex_attention (eager on CPU) in the inputs' dtype: (out, lse)."""
    bm = None
    if case.t_mask is not None:
        bm = t_create_block_mask(case.t_mask, B if case.per_batch else None, None, L, S, device="cpu",
                                 BLOCK_SIZE=bs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # "flex_attention called without torch.compile()"
        out, lse = t_flex_attention(*(torch.from_numpy(a) for a in (q, k, v)), score_mod=case.t_score,
                                    block_mask=bm, enable_gqa=case.gqa, return_lse=True)
    return out.numpy(), lse.numpy()


def torch_dense(case: Case, q, k, v, go=None, sink=None):
    """The dense equivalent in float64 torch, autograd through it: (out, lse, grads or None).

    scores = q·kᵀ·scale → score_mod → masked_fill(−inf) → softmax over [scores, sink] (a fully masked row
    without sink: 0) → drop the sink column → · v.
    """
    tq, tk, tv = (torch.from_numpy(a).double().requires_grad_() for a in (q, k, v))
    ts = None if sink is None else torch.from_numpy(sink).double().requires_grad_()
    Bn, Hn, L, E = q.shape
    S = k.shape[-2]
    kk, vv = tk, tv
    if case.gqa:
        kk, vv = tk.repeat_interleave(Hn // k.shape[1], dim=1), tv.repeat_interleave(Hn // k.shape[1], dim=1)
    s = (tq @ kk.transpose(-1, -2)) * (1 / math.sqrt(E))
    b = torch.arange(Bn).view(Bn, 1, 1, 1)
    h = torch.arange(Hn).view(1, Hn, 1, 1)
    qi, ki = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    if case.t_score is not None:
        s = case.t_score(s, b, h, qi, ki)
    if case.t_mask is not None:
        s = s.masked_fill(~torch.broadcast_to(case.t_mask(b, h, qi, ki), s.shape), float("-inf"))
    if ts is not None:
        s = torch.cat([s, ts.view(1, Hn, 1, 1).expand(Bn, Hn, L, 1)], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total == 0, torch.ones_like(total), total)
    lse = (m + torch.log(total)).squeeze(-1)
    out = p[..., :S] @ vv
    grads = None
    if go is not None:
        out.backward(torch.from_numpy(go).double())
        grads = [tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()] + ([] if ts is None else [ts.grad.numpy()])
    return out.detach().numpy(), lse.detach().numpy(), grads


def _tol(dtype):
    return dict(atol=1e-10, rtol=1e-10) if dtype == np.float64 else dict(atol=3e-5, rtol=3e-5)


def _sizes_for(dtype):
    return SIZES if dtype == np.float64 else [s for s in SIZES if s[:2] in ((59, 59), (257, 257), (130, 59))]


PARAMS = [(c, s, d) for d in (np.float64, np.float32) for c in CASES for s in _sizes_for(d)]
IDS = [f"{c}-{s[0]}x{s[1]}-bs{s[2]}-{np.dtype(d).name}" for c, s, d in PARAMS]


# ================================================================================================ forward
@pytest.mark.parametrize("name,size,dtype", PARAMS, ids=IDS)
def test_forward_matches_torch(backend, name, size, dtype):
    L, S, bs = size
    case = make_case(name, L, S)
    q, k, v, _, sink = inputs(case, L, S, dtype)
    bm = qkv_block_mask(case, L, S, bs)
    out, lse = qkv.flex_attention(q, k, v, score_mod=case.score, block_mask=bm, enable_gqa=case.gqa,
                                  return_lse=True, sink_logits=sink, backend=backend)
    assert out.dtype == dtype and out.shape == (B, H, L, v.shape[-1]) and lse.shape == (B, H, L)
    assert lse.dtype == dtype
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    if not case.sinks:                                           # torch's flex_attention itself
        t_out, t_lse = torch_flex(case, q, k, v, L, S, bs)
        np.testing.assert_allclose(out, t_out, **_tol(dtype))
        np.testing.assert_allclose(lse, t_lse, **_tol(dtype))    # natural log, −inf on empty rows, as torch
    d_out, d_lse, _ = torch_dense(case, q, k, v, sink=sink)     # the dense formula (sinks included)
    tol = _tol(dtype) if dtype == np.float64 else dict(atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out, d_out, **tol)
    np.testing.assert_allclose(lse, d_lse, **tol)


# =============================================================================================== backward
@pytest.mark.parametrize("name,size,dtype", PARAMS, ids=IDS)
def test_backward_matches_torch_autograd(backend, name, size, dtype):
    L, S, bs = size
    case = make_case(name, L, S)
    q, k, v, go, sink = inputs(case, L, S, dtype, seed=1)
    bm = qkv_block_mask(case, L, S, bs)
    grads = qkv.flex_attention_backward(go, q, k, v, score_mod=case.score, block_mask=bm, enable_gqa=case.gqa,
                                        sink_logits=sink, backend=backend)
    _, _, want = torch_dense(case, q, k, v, go=go, sink=sink)
    assert len(grads) == (4 if case.sinks else 3)
    tol = dict(atol=1e-9, rtol=1e-9) if dtype == np.float64 else dict(atol=2e-4, rtol=2e-4)
    for name_, g, w, like in zip(("dq", "dk", "dv", "dsink"), grads, want, (q, k, v, sink)):
        assert g.shape == like.shape and g.dtype == like.dtype, name_
        np.testing.assert_allclose(g, w, err_msg=name_, **tol)


# ======================================================================================== fully masked rows
@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_with_nothing_to_attend(backend, with_sinks):
    """Documents when L ≠ S: the queries of a document with no keys see nothing — output 0, lse −inf (with a
    sink: weights 0, output 0, lse = the sink), no NaN, no gradient."""
    L, S = 9, 5
    ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])                 # queries 5…8: document 2, no key there
    r = np.random.default_rng(3)
    q = r.standard_normal((B, H, L, 8))
    k, v = r.standard_normal((B, H, S, 8)), r.standard_normal((B, H, S, 6))
    go = r.standard_normal((B, H, L, 6))
    sink = r.standard_normal(H) if with_sinks else None
    bm = qkv.create_block_mask(mods.document(ids), None, None, L, S, BLOCK_SIZE=4)
    out, lse = qkv.flex_attention(q, k, v, block_mask=bm, return_lse=True, sink_logits=sink, backend=backend)
    assert np.all(out[:, :, 5:] == 0) and not np.isnan(out).any()
    if with_sinks:
        np.testing.assert_allclose(lse[:, :, 5:], np.broadcast_to(sink[None, :, None], (B, H, 4)), rtol=1e-12)
    else:
        assert np.all(lse[:, :, 5:] == -np.inf)
    grads = qkv.flex_attention_backward(go, q, k, v, block_mask=bm, sink_logits=sink, backend=backend)
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(grads[0][:, :, 5:] == 0)
    case = Case(mods.document(ids), lambda b, h, qi, ki: torch.from_numpy(ids)[qi] == torch.from_numpy(ids)[ki],
                sinks=with_sinks)
    d_out, _, want = torch_dense(case, q, k, v, go=go, sink=sink)
    np.testing.assert_allclose(out, d_out, atol=1e-12)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, atol=1e-10, rtol=1e-10)
    if not with_sinks:
        t_out, t_lse = torch_flex(case, q, k, v, L, S, 4)
        np.testing.assert_allclose(out, t_out, atol=1e-12)
        np.testing.assert_allclose(lse, t_lse, atol=1e-12)


def test_scale_and_auto_backend():
    r = np.random.default_rng(8)
    q, k, v = (r.standard_normal((1, 2, 30, 8)) for _ in range(3))
    bm = qkv.create_block_mask(mods.causal(), None, None, 30, 30, BLOCK_SIZE=8)
    out = qkv.flex_attention(q, k, v, mods.softcap(2.0), bm, scale=0.3)
    ref = qkv.flex_attention(q, k, v, mods.softcap(2.0), bm, scale=0.3, backend="reference")
    np.testing.assert_allclose(out, ref, atol=1e-12)
    case = Case(mods.causal(), lambda b, h, i, j: i >= j, mods.softcap(2.0), lambda s, *a: 2.0 * torch.tanh(s / 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbm = t_create_block_mask(case.t_mask, None, None, 30, 30, device="cpu", BLOCK_SIZE=8)
        t_out = t_flex_attention(*(torch.from_numpy(a) for a in (q, k, v)), case.t_score, tbm, scale=0.3)
    np.testing.assert_allclose(out, t_out.numpy(), atol=1e-12)
    g = qkv.flex_attention_backward(np.ones_like(out), q, k, v, mods.softcap(2.0), bm, scale=0.3)
    g_ref = qkv.flex_attention_backward(np.ones_like(out), q, k, v, mods.softcap(2.0), bm, scale=0.3,
                                        backend="reference")
    for a, b_ in zip(g, g_ref):
        np.testing.assert_allclose(a, b_, atol=1e-10)


def test_custom_score_mod_backward_needs_its_derivative(backend):
    r = np.random.default_rng(11)
    q, k, v = (r.standard_normal((1, 2, 9, 4)) for _ in range(3))
    go = r.standard_normal((1, 2, 9, 4))

    def cube(score, b, h, q_idx, kv_idx):
        return score ** 3 / 3
    with pytest.raises(ValueError, match=r"score_mod: cube has no derivative.*ScoreMod\(fn, grad="):
        qkv.flex_attention_backward(go, q, k, v, cube, backend=backend)
    with pytest.raises(ValueError, match="score_mod: compose has no derivative"):
        qkv.flex_attention_backward(go, q, k, v, mods.compose(mods.softcap(2.0), cube), backend=backend)
    qkv.flex_attention(q, k, v, cube, backend=backend)             # the forward needs no derivative
    with_grad = mods.ScoreMod(cube, grad=lambda s, b, h, i, j: s * s)
    got = qkv.flex_attention_backward(go, q, k, v, with_grad, backend=backend)
    case = Case(score=with_grad, t_score=lambda s, *a: s ** 3 / 3)
    _, _, want = torch_dense(case, q, k, v, go=go)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-10, rtol=1e-10)


# ================================================================================================ bad input


def test_bad_arrays():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"query: expected shape \(B, Hq, L, E\), \(Hq, L, E\) or \(L, E\), got "
                                         r"\(1, 2, 4, 8, 4\)"):
        qkv.flex_attention(q.reshape(1, 2, 4, 8, 4), k.reshape(1, 2, 4, 8, 4), v.reshape(1, 2, 4, 8, 4))
    with pytest.raises(TypeError, match="query: expected dtype float16, float32 or float64, got int64"):
        qkv.flex_attention(q.astype(int), k, v)
    with pytest.raises(TypeError, match="query, key, value: expected one dtype"):
        qkv.flex_attention(q.astype(np.float32), k, v)
    with pytest.raises(ValueError, match="key: expected last dimension E=4"):
        qkv.flex_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="value: expected 8 rows"):
        qkv.flex_attention(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match="query: expected finite numbers"):
        qkv.flex_attention(np.where(q > 1, np.nan, q), k, v)
    q8, k2, v2 = _qkv(Hq=4, Hk=2)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        qkv.flex_attention(q8, k2, v2)
    q3, k2, v2 = _qkv(Hq=3, Hk=2)
    with pytest.raises(ValueError, match=r"enable_gqa: the number of query heads \(3\) must be a multiple"):
        qkv.flex_attention(q3, k2, v2, enable_gqa=True)
    with pytest.raises(TypeError, match="query: expected a numpy.ndarray, got Tensor"):
        qkv.flex_attention(torch.zeros(1, 1, 2, 2), k, v)
