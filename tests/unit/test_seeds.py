"""The seeds' worked examples (../shared/seeds/), reproduced with their TRUE values.

Every expected number here was checked by hand (the arithmetic is written next to it). Where a seed prints a
different number, the test asserts the true one and says what the seed printed.
"""
import math

import numpy as np
import pytest

import qkv

# --- seed 003: 我 爱 吃, X (3×4), W_Q/W_K/W_V (4×3) ---------------------------------------------------------
X = np.array([[1.2, 0.8, -0.5, 0.3],     # 我
              [0.5, 1.3, 0.2, -0.7],     # 爱
              [-0.3, 0.9, 1.1, 0.4]])    # 吃
W_Q = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
W_K = np.array([[0.2, 0.3, 0.4], [0.5, 0.6, 0.7], [0.8, 0.9, 1.0], [1.1, 1.2, 1.3]])
W_V = np.array([[0.3, 0.4, 0.5], [0.6, 0.7, 0.8], [0.9, 1.0, 1.1], [1.2, 1.3, 1.4]])


@pytest.fixture(scope="module")
def seed003():
    t = qkv.Trace()
    out, w = qkv.attention(X, W_Q, W_K, W_V, trace=t)
    return t, out, w


def test_seed003_row_wo_is_right(seed003):
    t, _, _ = seed003
    # 1.2×0.1 + 0.8×0.4 + (−0.5)×0.7 + 0.3×1.0 = 0.12 + 0.32 − 0.35 + 0.30 = 0.39, as the seed says
    np.testing.assert_allclose(t["Q"].array[0], [0.39, 0.57, 0.75], atol=1e-12)
    np.testing.assert_allclose(t["K"].array[0], [0.57, 0.75, 0.93], atol=1e-12)
    np.testing.assert_allclose(t["V"].array[0], [0.75, 0.93, 1.11], atol=1e-12)


def test_seed003_rows_ai_and_chi_are_wrong_in_the_seed(seed003):
    t, _, _ = seed003
    # 爱_Q[0] = 0.5×0.1 + 1.3×0.4 + 0.2×0.7 + (−0.7)×1.0 = 0.05 + 0.52 + 0.14 − 0.70 = 0.01
    # (the seed prints 爱_Q = [0.05, 0.23, 0.41]: wrong)
    np.testing.assert_allclose(t["Q"].array[1], [0.01, 0.14, 0.27], atol=1e-12)
    np.testing.assert_allclose(t["K"].array[1], [0.14, 0.27, 0.40], atol=1e-12)   # seed: [0.23, 0.41, 0.59]
    np.testing.assert_allclose(t["V"].array[1], [0.27, 0.40, 0.53], atol=1e-12)   # seed: [0.41, 0.59, 0.77]
    # 吃_Q[0] = −0.3×0.1 + 0.9×0.4 + 1.1×0.7 + 0.4×1.0 = −0.03 + 0.36 + 0.77 + 0.40 = 1.50
    # (the seed prints 吃_Q = [0.89, 1.07, 1.25]: wrong)
    np.testing.assert_allclose(t["Q"].array[2], [1.50, 1.71, 1.92], atol=1e-12)
    np.testing.assert_allclose(t["K"].array[2], [1.71, 1.92, 2.13], atol=1e-12)   # seed: [1.07, 1.25, 1.43]
    np.testing.assert_allclose(t["V"].array[2], [1.92, 2.13, 2.34], atol=1e-12)   # seed: [1.25, 1.43, 1.61]


def test_seed003_chi_attention_true_values(seed003):
    t, out, w = seed003
    # 吃_Q · 我_K = 1.50×0.57 + 1.71×0.75 + 1.92×0.93 = 0.855 + 1.2825 + 1.7856 = 3.9231 (seed: 2.4723)
    # 吃_Q · 爱_K = 1.50×0.14 + 1.71×0.27 + 1.92×0.40 = 0.21 + 0.4617 + 0.768 = 1.4397   (seed: 1.3809)
    # 吃_Q · 吃_K = 1.50×1.71 + 1.71×1.92 + 1.92×2.13 = 2.565 + 3.2832 + 4.0896 = 9.9378 (seed: 4.0773)
    np.testing.assert_allclose(t["scores"].array[2], [3.9231, 1.4397, 9.9378], atol=1e-12)
    np.testing.assert_allclose(t["scaled"].array[2], np.array([3.9231, 1.4397, 9.9378]) / math.sqrt(3))
    # softmax of [2.26500, 0.83121, 5.73759]: exp = [9.6312, 2.2961, 310.3161], sum 322.2434
    np.testing.assert_allclose(w[2], [0.029888, 0.007125, 0.962987], atol=5e-7)   # seed: [0.246, 0.131, 0.623]
    # 0.029888×0.75 + 0.007125×0.27 + 0.962987×1.92 = 1.87327 (seed: 1.0170)
    np.testing.assert_allclose(out[2], [1.873274, 2.081808, 2.290341], atol=5e-6)  # seed: [1.0170, 1.1970, 1.3770]


def test_seed003_later_numbers_follow_from_its_wrong_vectors():
    """The seed's step 6-8 arithmetic is right for the vectors it printed: its errors are inherited."""
    q = np.array([0.89, 1.07, 1.25])
    K = np.array([[0.57, 0.75, 0.93], [0.23, 0.41, 0.59], [1.07, 1.25, 1.43]])
    V = np.array([[0.75, 0.93, 1.11], [0.41, 0.59, 0.77], [1.25, 1.43, 1.61]])
    out, w = qkv.scaled_dot_product_attention(q[None], K, V, return_weights=True)
    with qkv.trace() as t:
        qkv.scaled_dot_product_attention(q[None], K, V)
    np.testing.assert_allclose(t["scores"].array[0], [2.4723, 1.3809, 4.0773], atol=1e-12)
    np.testing.assert_allclose(w[0], [0.246, 0.131, 0.623], atol=6.5e-4)          # 0.2464 0.1312 0.6224
    np.testing.assert_allclose(out[0], [1.0170, 1.1970, 1.3770], atol=6e-4)       # 1.0166 1.1966 1.3766


# --- seed 000: Q, K given directly (3×4), d_k = 4 --------------------------------------------------------------
Q0 = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=float)
K0 = np.array([[0, 1, 0, 1], [1, 1, 1, 1], [2, 2, 2, 2]], dtype=float)


def test_seed000_scores_and_weights():
    with qkv.trace() as t:
        qkv.scaled_dot_product_attention(Q0, K0, np.eye(3))
    # [1,0,1,0]·[0,1,0,1] = 0 (the seed prints 1: wrong); the other eight scores are right
    np.testing.assert_array_equal(t["scores"].array, [[0, 2, 4], [4, 4, 8], [2, 4, 8]])
    np.testing.assert_array_equal(t["scaled"].array, [[0, 1, 2], [2, 2, 4], [1, 2, 4]])   # ÷ √4 = 2
    # row 0: softmax([0,1,2]) = [1, e, e²]/(1+e+e²) = [0.0900, 0.2447, 0.6652] (seed: [0.18, 0.24, 0.58])
    # row 1: softmax([2,2,4]) = [1, 1, e²]/(2+e²)    = [0.1065, 0.1065, 0.7870] (seed: [0.12, 0.12, 0.76])
    # row 2: softmax([1,2,4]) = [1, e, e³]/(1+e+e³)  = [0.0420, 0.1142, 0.8438] (seed: [0.09, 0.24, 0.67])
    e = math.e
    want = [[1 / (1 + e + e * e), e / (1 + e + e * e), e * e / (1 + e + e * e)],
            [1 / (2 + e * e), 1 / (2 + e * e), e * e / (2 + e * e)],
            [1 / (1 + e + e ** 3), e / (1 + e + e ** 3), e ** 3 / (1 + e + e ** 3)]]
    np.testing.assert_allclose(t["weights"].array, want, rtol=1e-12)
    np.testing.assert_allclose(t["weights"].array, [[0.0900, 0.2447, 0.6652], [0.1065, 0.1065, 0.7870],
                                                    [0.0420, 0.1142, 0.8438]], atol=5e-5)
    # even from its own scaled row [0.5, 1, 2] the seed's weights are off: softmax = [0.1402, 0.2312, 0.6285]
    w = qkv.stages.softmax(np.array([0.5, 1.0, 2.0]))
    np.testing.assert_allclose(w, [0.1402, 0.2312, 0.6285], atol=5e-5)


def test_seed000_multi_head_shapes():
    """Seed 000's whole path: ids → embeddings + positions → 8 heads of 64 → concat → W_O, (batch, 3, 512)."""
    emb = qkv.TokenEmbedding(1000, 512, seed=0)
    mha = qkv.MultiHeadAttention(512, 8, seed=0)
    with qkv.trace() as t:
        x = emb.embed([[101, 234, 567]])                              # (1, 3, 512)
        out, w = mha(x, need_weights=True, average_attn_weights=False)
    assert t["X"].shape == (1, 3, 512)
    assert t["Q_heads"].shape == (1, 8, 3, 64)                       # (batch, num_heads, seq_len, d_k)
    assert t["scores"].shape == (1, 8, 3, 3)
    assert t["scaled"].params["scale"] == 1 / 8                      # ÷ √64 = 8
    assert t["output"].shape == (1, 8, 3, 64)
    assert t["concat"].shape == (1, 3, 512)                          # 8 × 64 = 512
    assert out.shape == (1, 3, 512) and w.shape == (1, 8, 3, 3)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-6)


# --- seed 002: scores [4, 2, 0], d_k = 4, values [10, 0, −10] ----------------------------------------------------
def test_seed002_is_right():
    q = np.array([[4.0, 2.0, 0.0]])       # with K = I (3×3), q·kᵀ = [4, 2, 0] and E = 3; use scale = 1/√4
    with qkv.trace() as t:
        out = qkv.scaled_dot_product_attention(q, np.eye(3), np.array([[10.0], [0.0], [-10.0]]), scale=0.5)
    np.testing.assert_array_equal(t["scaled"].array, [[2, 1, 0]])
    # softmax([2,1,0]) = [e², e, 1]/(e²+e+1) = [0.6652, 0.2447, 0.0900]; the seed's [0.665, 0.245, 0.090] ✓
    np.testing.assert_allclose(t["weights"].array[0], [0.665, 0.245, 0.090], atol=5e-4)
    # 0.6652×10 + 0.2447×0 + 0.0900×(−10) = 5.752; the seed's ≈ 5.75 ✓
    np.testing.assert_allclose(out[0, 0], 5.75, atol=5e-3)
