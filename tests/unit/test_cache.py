"""KVCache and MultiHeadAttention(cache=): incremental decoding equals the full causal forward."""
import numpy as np
import pytest

import qkv


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("steps", [[1] * 9, [4, 1, 3, 1], [9]])
def test_incremental_decoding_equals_full_causal_forward(num_kv_heads, steps, rng):
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, dtype=np.float64, seed=3)
    mha.load(b_Q=rng.standard_normal(32), b_K=rng.standard_normal(mha.b_K.shape),
             b_V=rng.standard_normal(mha.b_V.shape), b_O=rng.standard_normal(32))
    x = rng.standard_normal((2, sum(steps), 32))
    full, _ = mha(x, is_causal=True)
    cache = qkv.KVCache()
    outs, t = [], 0
    for n in steps:
        out, w = mha(x[:, t:t + n], is_causal=True, cache=cache, need_weights=True, average_attn_weights=False)
        assert w.shape == (2, 4, n, t + n)
        # bottom-right: the new tokens see every cached token and each other causally
        assert np.array_equal(w[0, 0] > 0, qkv.masks.causal(n, t + n, align="bottom-right"))
        outs.append(out)
        t += n
        assert len(cache) == t
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-12)


def test_decoding_with_padding_and_unbatched(rng):
    mha = qkv.MultiHeadAttention(16, 2, dtype=np.float64, seed=1)
    x = rng.standard_normal((7, 16))
    full, _ = mha(x, is_causal=True)
    cache = qkv.KVCache()
    steps = [mha(x[i:i + 1], is_causal=True, cache=cache)[0] for i in range(7)]
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-12)
    # a key mask over all S tokens (cached + new) when decoding with padding
    xb = rng.standard_normal((2, 5, 16))
    real = np.array([[True] * 5, [True, True, False, True, True]])
    full, _ = mha(xb, is_causal=True, key_mask=real)
    cache = qkv.KVCache()
    a, _ = mha(xb[:, :3], is_causal=True, cache=cache, key_mask=real[:, :3])
    b, _ = mha(xb[:, 3:], is_causal=True, cache=cache, key_mask=real)
    np.testing.assert_allclose(np.concatenate([a, b], axis=1), full, atol=1e-12)


def test_cache_grows_and_keeps_values(rng):
    cache = qkv.KVCache()
    assert len(cache) == 0 and cache.keys is None
    ks, vs = [], []
    for n in [3, 20, 1, 40]:
        k, v = rng.standard_normal((1, 2, n, 4)), rng.standard_normal((1, 2, n, 5))
        ks.append(k)
        vs.append(v)
        K, V = cache.append(k, v)
    np.testing.assert_array_equal(K, np.concatenate(ks, axis=2))
    np.testing.assert_array_equal(V, np.concatenate(vs, axis=2))
    assert len(cache) == 64 and "64" in repr(cache)
    cache.reset()
    assert len(cache) == 0 and cache.values is None


def test_cache_bad_input(rng):
    cache = qkv.KVCache()
    cache.append(np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 3, 4)))
    with pytest.raises(ValueError, match="key/value"):
        cache.append(np.zeros((1, 3, 1, 4)), np.zeros((1, 3, 1, 4)))
    with pytest.raises(TypeError, match="dtype"):
        cache.append(np.zeros((1, 2, 1, 4), np.float32), np.zeros((1, 2, 1, 4), np.float32))
    with pytest.raises(ValueError, match="value"):
        cache.append(np.zeros((1, 2, 1, 4)), np.zeros((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="key"):
        cache.append(np.zeros((2, 1, 4)), np.zeros((2, 1, 4)))
    mha = qkv.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(TypeError, match="cache"):
        mha(np.zeros((1, 3, 8), np.float32), cache={})


def test_reserve_hands_out_the_new_tokens_views_and_checks_as_append(rng):
    cache = qkv.KVCache()
    k, v = cache.reserve((1, 2, 3, 4), (1, 2, 3, 5), np.float32)
    assert k.shape == (1, 2, 3, 4) and v.shape == (1, 2, 3, 5) and cache.offset == 3
    k[...], v[...] = 1.0, 2.0
    more = rng.standard_normal((1, 2, 30, 4)).astype(np.float32), rng.standard_normal((1, 2, 30, 5)).astype(np.float32)
    K, V = cache.append(*more)                                          # grows past the first capacity: kept
    assert (K[:, :, :3] == 1).all() and (V[:, :, :3] == 2).all()
    np.testing.assert_array_equal(K[:, :, 3:], more[0])
    with pytest.raises(ValueError, match="key/value"):
        cache.reserve((1, 3, 1, 4), (1, 3, 1, 5), np.float32)
    with pytest.raises(TypeError, match="dtype"):
        cache.reserve((1, 2, 1, 4), (1, 2, 1, 5), np.float64)
    with pytest.raises(TypeError, match="value: expected dtype"):
        qkv.KVCache().reserve((1, 2, 1, 4), (1, 2, 1, 5), np.float32, np.float64)
    with pytest.raises(ValueError, match="4 dimensions"):
        qkv.KVCache().reserve((2, 1, 4), (2, 1, 4), np.float32)
    assert cache.offset == 33                                           # the refused reservations took nothing
