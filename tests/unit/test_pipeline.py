"""One pipeline: every consumer runs qkv.pipeline.attend; backends are objects the dispatcher asks."""
import numpy as np
import pytest

import qkv
from qkv import backends, mods, pipeline, stages
from qkv.backends.base import Backend
from qkv.explain import examples


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = pipeline.attend

    def counting(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)
    monkeypatch.setattr(pipeline, "attend", counting)
    return seen


def test_reference_backend_sdpa_attention_and_mha_run_the_pipeline(calls):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 5, 4))
    qkv.scaled_dot_product_attention(q, q, q, backend="reference")
    assert len(calls) == 1
    qkv.attention(q[0, 0], np.eye(4), np.eye(4), np.eye(4))
    assert len(calls) == 2
    qkv.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)(rng.standard_normal((1, 5, 8)))
    assert len(calls) == 3


@pytest.mark.parametrize("name", examples.builtin_names())
def test_every_builtin_example_runs_the_pipeline(calls, name):
    examples.run(examples.load_example(name))
    assert len(calls) >= 1


@pytest.mark.parametrize("name", ["seed003", "seed000", "seed002"])
def test_the_checker_runs_the_pipeline(calls, name):
    qkv.explain.check(examples.load_example(name))
    assert len(calls) >= 2                       # the true values and what follows from the claims


def test_trace_substitute_replaces_a_step_and_the_rest_follows():
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = np.array([[1.0], [2.0]])

    def sub(name, a):
        return np.zeros_like(a) if name == stages.Names.SCALED else a
    t = qkv.Trace(substitute=sub)
    with qkv.trace(t):
        out, w, _ = pipeline.attend(q, q, v, scale=1.0)
    assert np.allclose(w, 0.5) and np.allclose(out, 1.5)       # equal scores → uniform weights
    assert not np.allclose(t["scaled"].array, 0)                # the step keeps what the stage computed


def test_pipeline_steps_in_order_with_every_variant():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 4)) for _ in range(3))
    mod = mods.compose(mods.alibi(mods.alibi_slopes(2)), mods.softcap(5.0))
    with qkv.trace() as t:
        pipeline.attend(q, k, v, scale=0.5, mask=qkv.masks.causal(4), score_mod=mod,
                        sink_logits=np.array([0.1, -0.2]))
    names = t.names()
    assert names == ["scores", "scaled", "biased", "capped", "masked", "weights", "output"]
    order = [n for n in stages.PIPELINE_ORDER if n in names]
    assert order == names


def test_backends_are_objects_with_forward_backward_and_supports():
    for name in ("reference", "tiled", "torch"):
        b = backends.get(name)
        assert isinstance(b, Backend) and b.name == name
        assert callable(b.forward) and callable(b.backward)
    assert backends.get("torch").supports(score_mod=lambda *a: a[0]) is not None
    assert backends.get("reference").supports(score_mod=lambda *a: a[0], sink_logits=np.zeros(2),
                                              backward=True) is None


def test_choose_auto_asks_the_backends_and_a_new_backend_plugs_in(monkeypatch):
    big = np.zeros((1, 8, 512, 8), np.float32)
    assert backends.choose_auto(big, big, big) == "tiled"
    small = np.zeros((1, 2, 16, 8), np.float32)
    assert backends.choose_auto(small, small, small) == "reference"

    class Echo(Backend):
        name = "echo"
        features = frozenset({"mask", "causal"})

        def prefers(self, query, key, value, *, enable_gqa=False):
            return True

        def forward(self, query, key, value, **kw):
            return np.full(query.shape[:-1] + value.shape[-1:], 7.0, query.dtype), None, None
    monkeypatch.setitem(backends.BACKENDS, "echo", Echo())         # registered last: asked after the built-ins
    assert backends.choose_auto(small, small, small) == "echo"
    out = qkv.scaled_dot_product_attention(small, small, small)
    assert np.all(out == 7.0)
    # a request it does not support goes on down the list
    assert backends.choose_auto(small, small, small, return_weights=True) == "reference"


def test_qkv_attention_and_trace_no_longer_hide_their_modules():
    import importlib
    assert callable(qkv.attention) and callable(qkv.trace)
    assert importlib.import_module("qkv.sdpa").scaled_dot_product_attention is qkv.scaled_dot_product_attention
    assert importlib.import_module("qkv.tracing").Trace is qkv.Trace
    assert qkv.backends.choose_auto is importlib.import_module("qkv.sdpa").choose_auto


def test_layer_is_what_multi_head_attention_runs_and_row_blocks_give_the_same_output():
    """pipeline.layer: X → Q, K, V → heads → attend → concat → W_O, whole or by blocks of query rows."""
    rng = np.random.default_rng(3)
    D, H, Hk = 8, 4, 2
    mha = qkv.MultiHeadAttention(D, H, num_kv_heads=Hk, dtype=np.float64, seed=1)
    mha.b_Q[:] = rng.standard_normal(D)
    x = rng.standard_normal((2, 5, D))
    want, _ = mha(x)
    with qkv.trace() as t:
        got, _ = pipeline.layer(x, mha.W_Q, mha.W_K, mha.W_V, mha.W_O, b_q=mha.b_Q, b_k=mha.b_K, b_v=mha.b_V,
                                b_o=mha.b_O, heads=H, kv_heads=Hk,
                                attend=lambda q, k, v, rows: (qkv.scaled_dot_product_attention(
                                    q, k, v, enable_gqa=True), None))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert t.names()[:7] == ["X", "Q", "K", "V", "Q_heads", "K_heads", "V_heads"]
    assert t.names()[-2:] == ["concat", "final_output"]
    seen = []

    def attend(q, k, v, rows):
        seen.append(rows)
        return qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True), None

    blocks, aux = pipeline.layer(x, mha.W_Q, mha.W_K, mha.W_V, mha.W_O, b_q=mha.b_Q, b_k=mha.b_K, b_v=mha.b_V,
                                 b_o=mha.b_O, heads=H, kv_heads=Hk, attend=attend, row_block=2)
    assert seen == [(0, 2), (2, 4), (4, 5)] and aux == [None, None, None]
    np.testing.assert_allclose(blocks, want, rtol=1e-12, atol=1e-12)


def test_layer_without_heads_is_the_seeds_single_head_calculation():
    rng = np.random.default_rng(4)
    x, w_q, w_k, w_v = rng.standard_normal((3, 4)), *(rng.standard_normal((4, 3)) for _ in range(3))
    out, w = pipeline.layer(x, w_q, w_k, w_v)                              # default attend: 1/√E, no mask
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    s = q @ k.T / np.sqrt(3)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(w, p, rtol=1e-12)
    np.testing.assert_allclose(out, p @ v, rtol=1e-12)
