"""qkv.flex_attention against torch's flex_attention (CPU, eager) and flex_attention_backward against torch
autograd through the dense equivalent, on the reference and the tiled backend; every bad input.

Each qkv mod is translated to the torch mod it stands for (written with torch ops); sink_logits, which torch's
flex_attention does not have, are held to the dense formula softmax([scores, sink]) without the sink column.
"""

import numpy as np
import pytest

import qkv
from qkv import mods
from qkv.backends import tiled


BACKENDS = ["reference", "tiled"]
B, H = 2, 4


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
