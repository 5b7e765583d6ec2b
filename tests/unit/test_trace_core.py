"""The trace observes the one computation path: what it holds is what the stages computed."""
import numpy as np

import qkv
from qkv import gemm
from test_seeds import W_K, W_Q, W_V, X


def test_trace_records_the_stages_in_order_and_equals_the_result():
    t = qkv.Trace()
    out, w = qkv.attention(X, W_Q, W_K, W_V, is_causal=True, trace=t)
    assert t.names() == ["X", "Q", "K", "V", "scores", "scaled", "masked", "weights", "output"]
    np.testing.assert_array_equal(t["weights"].array, w)
    np.testing.assert_array_equal(t["output"].array, out)
    np.testing.assert_array_equal(t["Q"].array, gemm.matmul(X, W_Q))   # the product qkv's provider computed
    assert t["masked"].array[0, 1] == -np.inf
    assert t["scaled"].params["is_default"] and t["scaled"].params["d_k"] == 3


def test_matmul_terms_are_the_operands():
    t = qkv.Trace()
    qkv.attention(X, W_Q, W_K, W_V, trace=t)
    terms = t["Q"].terms((0, 0))
    assert terms == [(1.2, 0.1), (0.8, 0.4), (-0.5, 0.7), (0.3, 1.0)]
    assert abs(sum(a * b for a, b in terms) - t["Q"].array[0, 0]) < 1e-12
    s_terms = t["scores"].terms((2, 0))                    # 吃_Q · 我_K
    np.testing.assert_allclose([a for a, _ in s_terms], t["Q"].array[2])
    np.testing.assert_allclose([b for _, b in s_terms], t["K"].array[0])
    o_terms = t["output"].terms((2, 1))                    # Σ_j weights[2, j] · V[j, 1]
    np.testing.assert_allclose([a for a, _ in o_terms], t["weights"].array[2])


def test_no_trace_records_nothing_and_context_manager_nests():
    with qkv.trace() as outer:
        qkv.scaled_dot_product_attention(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 1)))
        inner = qkv.Trace()
        qkv.scaled_dot_product_attention(np.ones((1, 3)), np.ones((2, 3)), np.ones((2, 1)), trace=inner)
    assert outer.names() == ["Q", "K", "V", "scores", "scaled", "weights", "output"]
    assert inner["scores"].shape == (1, 2)
    assert qkv.trace is qkv.tracing.trace and qkv.trace.__module__ == "qkv.core.tracing"   # (qkv.tracing: public)
