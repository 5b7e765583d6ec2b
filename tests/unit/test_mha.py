"""qkv.MultiHeadAttention against torch.nn.MultiheadAttention (and torch SDPA for grouped-query)."""
import numpy as np

import qkv


def test_is_causal_equals_explicit_causal_mask(rng):
    ours = qkv.MultiHeadAttention(12, 3, seed=0)
    x = rng.standard_normal((2, 6, 12)).astype(np.float32)
    a, wa = ours(x, is_causal=True, need_weights=True)
    b, _ = ours(x, attn_mask=qkv.masks.causal(6))
    np.testing.assert_array_equal(a, b)
    assert np.all(np.triu(wa[0], 1) == 0)


def test_weights_in_the_seeds_layout(rng):
    m = qkv.MultiHeadAttention(8, 2, seed=3, dtype=np.float64)
    x = rng.standard_normal((1, 4, 8))
    with qkv.trace() as t:
        m(x)
    np.testing.assert_allclose(t["Q"].array, x @ m.W_Q + m.b_Q)          # Q = X @ W_Q
    assert t["Q_heads"].shape == (1, 2, 4, 4)                              # (batch, heads, seq, d_k)
    np.testing.assert_allclose(t["final_output"].array, t["concat"].array @ m.W_O + m.b_O)


def test_seed_makes_initialization_reproducible():
    a, b = qkv.MultiHeadAttention(8, 2, seed=5), qkv.MultiHeadAttention(8, 2, seed=5)
    for name, value in a.parameters().items():
        np.testing.assert_array_equal(value, b.parameters()[name])
