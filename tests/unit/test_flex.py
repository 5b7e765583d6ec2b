"""qkv.flex_attention against torch's flex_attention (CPU, eager) and flex_attention_backward against torch
autograd through the dense equivalent, on the reference and the tiled backend; every bad input.

Each qkv mod is translated to the torch mod it stands for (written with torch ops); sink_logits, which torch's
flex_attention does not have, are held to the dense formula softmax([scores, sink]) without the sink column.
"""
import math
import warnings

import numpy as np
import pytest

import qkv
from qkv import mods
from qkv.backends import tiled

torch = pytest.importorskip("torch")
from torch.nn.attention.flex_attention import create_block_mask as t_create_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as t_flex_attention  # noqa: E402

BACKENDS = ["reference", "tiled"]
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


def test_a_score_mod_that_removes_keys_with_minus_inf(backend):
    """−inf from a score_mod removes the key (as torch); a row it empties gives 0, not NaN."""
    def drop_far(score, b, h, q_idx, kv_idx):
        return np.where((kv_idx > q_idx) | (q_idx == 2), -np.inf, score)
    sm = mods.ScoreMod(drop_far, grad=lambda s, b, h, q, kv: np.ones(()))
    r = np.random.default_rng(4)
    q, k, v = (r.standard_normal((1, 2, 6, 4)) for _ in range(3))
    out = qkv.flex_attention(q, k, v, score_mod=sm, backend=backend)
    want = qkv.flex_attention(q, k, v, block_mask=qkv.create_block_mask(lambda b, h, i, j: (j <= i) & (i != 2),
                                                                        None, None, 6, 6), backend="reference")
    np.testing.assert_allclose(out, want, atol=1e-12)
    assert np.all(out[:, :, 2] == 0)
    g = qkv.flex_attention_backward(np.ones_like(out), q, k, v, score_mod=sm, backend=backend)
    assert all(np.isfinite(x).all() for x in g)


# ==================================================================================== shapes, dtypes, misc
def test_three_and_two_dimensional_inputs(backend):
    r = np.random.default_rng(5)
    q, k, v = r.standard_normal((H, 33, 8)), r.standard_normal((H, 40, 8)), r.standard_normal((H, 40, 5))
    sm = mods.alibi(mods.alibi_slopes(H))
    bm3 = qkv.create_block_mask(mods.causal(), None, H, 33, 40, BLOCK_SIZE=16)
    sink = r.standard_normal(H)
    out3, lse3 = qkv.flex_attention(q, k, v, sm, bm3, return_lse=True, sink_logits=sink, backend=backend)
    out4, lse4 = qkv.flex_attention(q[None], k[None], v[None], sm, bm3, return_lse=True, sink_logits=sink,
                                    backend="reference")
    assert out3.shape == (H, 33, 5) and lse3.shape == (H, 33)
    np.testing.assert_allclose(out3, out4[0], atol=1e-12)
    np.testing.assert_allclose(lse3, lse4[0], atol=1e-12)
    go = r.standard_normal(out3.shape)
    g3 = qkv.flex_attention_backward(go, q, k, v, sm, bm3, sink_logits=sink, backend=backend)
    g4 = qkv.flex_attention_backward(go[None], q[None], k[None], v[None], sm, bm3, sink_logits=sink,
                                     backend="reference")
    assert [g.shape for g in g3] == [q.shape, k.shape, v.shape, (H,)]
    for a, b_ in zip(g3, g4):
        np.testing.assert_allclose(a, b_.reshape(a.shape), atol=1e-12)
    # (L, E): b = h = 0; one sink logit
    q2, k2, v2 = q[1], k[1], v[1]
    bm2 = qkv.create_block_mask(mods.causal(), None, None, 33, 40, BLOCK_SIZE=16)
    out2, lse2 = qkv.flex_attention(q2, k2, v2, sm, bm2, return_lse=True, sink_logits=sink[:1], backend=backend)
    ref, ref_lse = qkv.flex_attention(q2[None, None], k2[None, None], v2[None, None], sm, bm2, return_lse=True,
                                      sink_logits=sink[:1], backend="reference")
    assert out2.shape == (33, 5) and lse2.shape == (33,)
    np.testing.assert_allclose(out2, ref[0, 0], atol=1e-12)
    g2 = qkv.flex_attention_backward(r.standard_normal((33, 5)), q2, k2, v2, sm, bm2, sink_logits=sink[:1],
                                     backend=backend)
    assert [g.shape for g in g2] == [q2.shape, k2.shape, v2.shape, (1,)]


def test_key_batch_broadcasts(backend):
    r = np.random.default_rng(6)
    q = r.standard_normal((B, H, 20, 8))
    k, v = r.standard_normal((1, H, 20, 8)), r.standard_normal((1, H, 20, 8))
    bm = qkv.create_block_mask(mods.causal(), 1, 1, 20, 20, BLOCK_SIZE=8)         # built for 1: broadcast
    out = qkv.flex_attention(q, k, v, block_mask=bm, backend=backend)
    want = qkv.flex_attention(q, np.repeat(k, B, 0), np.repeat(v, B, 0), block_mask=bm, backend="reference")
    np.testing.assert_allclose(out, want, atol=1e-12)
    go = r.standard_normal(out.shape)
    dq, dk, dv = qkv.flex_attention_backward(go, q, k, v, block_mask=bm, backend=backend)
    _, dk2, dv2 = qkv.flex_attention_backward(go, q, np.repeat(k, B, 0), np.repeat(v, B, 0), block_mask=bm,
                                              backend="reference")
    assert dk.shape == k.shape
    np.testing.assert_allclose(dk, dk2.sum(0, keepdims=True), atol=1e-10)
    np.testing.assert_allclose(dv, dv2.sum(0, keepdims=True), atol=1e-10)


def test_float16_computes_in_float32(backend):
    r = np.random.default_rng(7)
    q, k, v = (r.standard_normal((1, 2, 40, 8)).astype(np.float16) for _ in range(3))
    sm = mods.softcap(3.0)
    bm = qkv.create_block_mask(mods.sliding_window(9), None, None, 40, 40, BLOCK_SIZE=16)
    out, lse = qkv.flex_attention(q, k, v, sm, bm, return_lse=True, backend=backend)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    want = qkv.flex_attention(*(a.astype(np.float32) for a in (q, k, v)), sm, bm, backend="reference")
    np.testing.assert_allclose(out.astype(np.float32), want, atol=2e-3, rtol=2e-3)
    g = qkv.flex_attention_backward(np.ones_like(out), q, k, v, sm, bm, backend=backend)
    assert all(x.dtype == np.float16 for x in g)


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


def test_no_mods_equals_sdpa():
    r = np.random.default_rng(9)
    q, k, v = (r.standard_normal((2, 3, 17, 8)) for _ in range(3))
    np.testing.assert_allclose(qkv.flex_attention(q, k, v), qkv.scaled_dot_product_attention(q, k, v), atol=1e-14)
    bm = qkv.create_block_mask(mods.causal(), None, None, 17, 17, BLOCK_SIZE=4)
    np.testing.assert_allclose(qkv.flex_attention(q, k, v, block_mask=bm),
                               qkv.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-14)


def test_trace_records_the_mod_steps():
    r = np.random.default_rng(10)
    q, k, v = (r.standard_normal((1, 2, 5, 4)) for _ in range(3))
    bm = qkv.create_block_mask(mods.causal(), None, None, 5, 5, BLOCK_SIZE=2)
    with qkv.trace() as t:
        qkv.flex_attention(q, k, v, mods.compose(mods.alibi(mods.alibi_slopes(2)), mods.softcap(4.0)), bm,
                           sink_logits=np.zeros(2))
    names = t.names()
    assert [n for n in ("scaled", "biased", "capped", "masked", "weights", "output") if n in names] == \
        ["scaled", "biased", "capped", "masked", "weights", "output"]
    assert np.allclose(t["weights"].array.sum(-1) < 1, True)    # the sink takes part of each row's weight


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


def test_finite_input_never_gives_nan(backend):
    """Scores beyond float32 are computed in float64 (and cast back); beyond float64 a ValueError; a score mod
    that overflows is named."""
    r = np.random.default_rng(13)
    q = (r.standard_normal((1, 2, 6, 2)) * 3e19).astype(np.float32)
    bm = qkv.create_block_mask(mods.causal(), None, None, 6, 6, BLOCK_SIZE=4)
    sm = mods.softcap(1e30)
    out = qkv.flex_attention(q, q, q, sm, bm, backend=backend)
    want = qkv.flex_attention(q.astype(np.float64), q.astype(np.float64), q.astype(np.float64), sm, bm,
                              backend="reference")
    assert out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_allclose(out, want.astype(np.float32), rtol=1e-6)
    g = qkv.flex_attention_backward(np.ones_like(out) * 1e-30, q, q, q, sm, bm, backend=backend)
    assert all(x.dtype == np.float32 and np.isfinite(x).all() for x in g)
    huge = np.full((1, 1, 3, 2), 1e160)
    with pytest.raises(ValueError, match="query, key: the scores .* over the .* that float64"):
        qkv.flex_attention(huge, huge, huge, backend=backend)
    small = r.standard_normal((1, 1, 3, 2)).astype(np.float32)

    def blow_up(s, b, h, q_idx, kv_idx):
        with np.errstate(over="ignore"):
            return np.abs(s) * np.float32(1e38) * np.float32(1e10)
    with pytest.raises(ValueError, match="score_mod: expected finite scores or −inf .*got inf at index"):
        qkv.flex_attention(small, small, small, blow_up, backend=backend)


# ================================================================================================ bad input
def _qkv(L=8, S=8, Hq=H, Hk=H, dtype=np.float64):
    r = np.random.default_rng(12)
    return (r.standard_normal((B, Hq, L, 4)).astype(dtype), r.standard_normal((B, Hk, S, 4)).astype(dtype),
            r.standard_normal((B, Hk, S, 4)).astype(dtype))


BAD = [
    (dict(score_mod=3), TypeError, "score_mod: expected a callable"),
    (dict(score_mod=mods.causal()), TypeError, "score_mod: expected .* got the mask mod causal"),
    (dict(block_mask=mods.causal()), TypeError, r"block_mask: expected a BlockMask, got the callable causal\(\); "
                                                r"build one once with qkv.create_block_mask\(mask_mod, B, H, 8, 8\)"),
    (dict(block_mask=lambda b, h, q, kv: q >= kv), TypeError, "block_mask: expected a BlockMask, got the callable"),
    (dict(block_mask=np.ones((8, 8), bool)), TypeError, "block_mask: expected a BlockMask from qkv.create_block_mask"),
    (dict(block_mask=qkv.create_block_mask(mods.causal(), None, None, 8, 9)), ValueError,
     "block_mask: built for Q_LEN=8, KV_LEN=9, but the query has L=8 and the key S=8"),
    (dict(block_mask=qkv.create_block_mask(mods.causal(), 3, None, 8, 8)), ValueError,
     "block_mask: built for B=3, but the input has B=2"),
    (dict(block_mask=qkv.create_block_mask(mods.causal(), None, 2, 8, 8)), ValueError,
     "block_mask: built for H=2, but the input has H=4"),
    (dict(sink_logits=np.zeros(3)), ValueError, r"sink_logits: expected shape \(4,\) \(one logit per query head\), "
                                                r"got \(3,\)"),
    (dict(sink_logits=np.zeros((1, 4))), ValueError, r"sink_logits: expected shape \(4,\)"),
    (dict(sink_logits=0.5), ValueError, r"sink_logits: expected shape \(4,\).*got \(\)"),
    (dict(sink_logits=np.zeros(4, int)), TypeError, "sink_logits: expected dtype float16, float32 or float64, got int"),
    (dict(sink_logits=np.array([0, np.nan, 0, 0])), ValueError, "sink_logits: expected finite numbers"),
    (dict(sink_logits=np.array([0, np.inf, 0, 0])), ValueError, "sink_logits: expected finite numbers"),
    (dict(sink_logits="1"), TypeError, "sink_logits: expected a numpy.ndarray"),
    (dict(scale=float("nan")), ValueError, "scale: expected a finite number"),
    (dict(scale="1"), ValueError, "scale: expected a finite number"),
    (dict(enable_gqa=1), TypeError, "enable_gqa: expected True or False"),
    (dict(backend="nope"), ValueError, "backend: expected one of"),
    (dict(backend="torch", score_mod=mods.softcap(1.0)), ValueError, "backend: the 'torch' backend does not compute"),
    (dict(threads=0), ValueError, "threads: expected an integer >= 1"),
    (dict(return_lse="yes"), TypeError, "return_lse: expected True or False"),
]


@pytest.mark.parametrize("kw,exc,match", BAD, ids=[f"{i}-{next(iter(b[0]))}" for i, b in enumerate(BAD)])
def test_bad_arguments(kw, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        qkv.flex_attention(q, k, v, **kw)
    if "return_lse" in kw:
        return
    with pytest.raises(exc, match=match):             # the backward validates the same way, before any work
        qkv.flex_attention_backward(np.zeros((B, H, 8, 4)), q, k, v, **kw)


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


def test_bad_grad_out():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"grad_out: expected the output's shape \(2, 4, 8, 4\), got \(2, 4, 8, 3\)"):
        qkv.flex_attention_backward(np.zeros((B, H, 8, 3)), q, k, v)
    with pytest.raises(TypeError, match="grad_out: expected dtype float64 \\(as query\\), got float32"):
        qkv.flex_attention_backward(np.zeros((B, H, 8, 4), np.float32), q, k, v)
    with pytest.raises(ValueError, match="grad_out: expected finite numbers"):
        qkv.flex_attention_backward(np.full((B, H, 8, 4), np.inf), q, k, v)
    with pytest.raises(TypeError, match="threads: expected an integer"):
        qkv.flex_attention_backward(np.zeros((B, H, 8, 4)), q, k, v, threads=1.5)


def test_bad_block_mask_and_mods_through_flex():
    q, k, v = _qkv(L=8, S=8)
    with pytest.raises(ValueError, match="doc_ids: expected 8 document ids"):
        qkv.create_block_mask(mods.document(np.zeros(7, int)), None, None, 8, 8)
    with pytest.raises(TypeError, match="mask_mod: expected it to return dtype bool"):
        qkv.create_block_mask(lambda b, h, i, j: i - j, None, None, 8, 8)
    with pytest.raises(ValueError, match=r"slopes: expected one slope per query head \(H=4\), got 2"):
        qkv.flex_attention_backward(np.zeros((B, H, 8, 4)), q, k, v,
                                    mods.compose(mods.softcap(1.0), mods.alibi([0.5, 0.25])))
