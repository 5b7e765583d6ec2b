"""KVCache(dtype=np.float16 | np.int8): the storage's round trip, its growth, its errors, and the compiled decode
kernel (qkv.compute.kv_decode) against float64 attention over the dequantized cache (NumPy and numba only)."""
import math

import numpy as np
import pytest

import qkv
from qkv.compute import kv_decode
from qkv.core import kv_quant as _kv_quant
from qkv.engine import kv_attention
from qkv.engine.kv_attention import DECODE_MAX_ROWS, cache_attention

QDTYPES = [np.float16, np.int8]


def _rows(rng, shape, spread=True):
    """Rows of very different sizes (as keys are): each row scaled by 10^U(−3, 3), one row of zeros."""
    x = rng.standard_normal(shape)
    if spread:
        x *= 10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,))
    x.reshape(-1, shape[-1])[0] = 0.0
    return x.astype(np.float32)


def _reference(q, k, v, scale):
    """float64 softmax(q·kᵀ·scale)·v, causal bottom-right, grouped-query heads."""
    B, H, L, _ = q.shape
    Hk, S = k.shape[1], k.shape[2]
    g = H // Hk
    k = np.repeat(k.astype(np.float64), g, axis=1)
    v = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("bhle,bhse->bhls", q.astype(np.float64), k) * scale
    s = np.where(np.arange(S)[None, :] <= (S - L + np.arange(L))[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


# ---------------------------------------------------------------------------------------------- storage
@pytest.mark.parametrize("E", [64, 16, 40, 96])
def test_int8_round_trip_within_half_a_step_of_each_block(E, rng):
    x = _rows(rng, (2, 3, 50, E))
    x[0, 0, 1, :5] = 1e-30                                              # a block far below float16's subnormals
    q, d = np.empty(x.shape, np.int8), np.empty(x.shape[:-1] + (_kv_quant.blocks(E),), np.float16)
    _kv_quant.store(x, q, d, "key")
    back = _kv_quant.load(q, d, np.float32)
    step = np.repeat(d.astype(np.float32), 32, axis=-1)[..., :E]       # each element's block scale
    assert np.all(np.abs(x - back) <= step / 2 * (1 + 1e-6))
    assert np.abs(q.astype(int)).max() <= 127 and np.all(d[0, 0, 0] == 0)     # the zero row: d 0, q 0
    amax = np.abs(np.pad(x, [(0, 0)] * 3 + [(0, -E % 32)])).reshape(d.shape + (32,)).max(axis=-1)
    assert np.all(d.astype(np.float32) >= amax / 127)                   # the float16 scale is rounded up
    assert np.all(d.astype(np.float32) <= amax / 127 * (1 + 2.0 ** -10) + 6e-8)


def test_float16_round_trip_is_float16_rounding(rng):
    x = _rows(rng, (1, 2, 40, 64))
    c = qkv.KVCache(dtype=np.float16)
    c.append(x, 2 * x)
    assert c.keys.dtype == np.float32 and np.array_equal(c.keys, x.astype(np.float16).astype(np.float32))
    normal = np.abs(x) >= 2.0 ** -14
    assert np.all(np.abs(c.keys - x)[normal] <= 2.0 ** -11 * np.abs(x)[normal])
    assert np.all(np.abs(c.keys - x)[~normal] <= 2.0 ** -25)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_appends_across_capacity_growth_and_reserve(dtype, rng):
    c = qkv.KVCache(dtype=dtype)
    ks, vs = [], []
    for n in [3, 20, 1, 40, 1]:                                          # capacity 16 → 32 → 64 → 128
        k, v = _rows(rng, (2, 3, n, 64)), _rows(rng, (2, 3, n, 32))
        ks.append(k)
        vs.append(v)
        if n == 40:                                                      # reserve: stored at the next read
            k_new, v_new = c.reserve(k.shape, v.shape, k.dtype)
            k_new[...], v_new[...] = k, v
            assert len(c) == 64
        else:
            keys, values = c.append(k, v)
            assert keys.shape == (2, 3, len(c), 64) and values.shape == (2, 3, len(c), 32)
    one = qkv.KVCache(dtype=dtype)
    one.append(np.concatenate(ks, axis=2), np.concatenate(vs, axis=2))
    assert np.array_equal(c.keys, one.keys) and np.array_equal(c.values, one.values)   # growth loses nothing
    k_st, v_st, k_sc, v_sc = c.storage()
    assert k_st.dtype == dtype and k_st.shape[2] == 128 and k_st.flags.c_contiguous
    assert (k_sc is None) == (dtype == np.float16)
    per = 2 * 3 * ((64 + 32) * 2 if dtype == np.float16 else (64 + 32) + 2 * (2 + 1))
    assert c.nbytes_per_token() == per and "dtype=" in repr(c) and c.quantized and c.dtype == dtype


def test_float64_rows_come_back_as_float64_and_mha_decodes_with_a_quantized_cache(rng):
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=2, dtype=np.float64, seed=3)
    x = rng.standard_normal((2, 9, 32))
    full, _ = mha(x, is_causal=True)
    for dtype, tol in ((np.float16, 2e-3), (np.int8, 2e-2)):
        cache = qkv.KVCache(dtype=dtype)
        outs = [mha(x[:, :4], is_causal=True, cache=cache)[0]] + \
            [mha(x[:, t:t + 1], is_causal=True, cache=cache)[0] for t in range(4, 9)]
        assert cache.keys.dtype == np.float64
        np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=tol * np.abs(full).max())


def test_default_cache_is_unchanged_float_storage(rng):
    c = qkv.KVCache()
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    keys, _ = c.append(k, k)
    assert not c.quantized and c.dtype is None and np.shares_memory(keys, c.storage()[0])
    assert c.storage()[2] is None and c.nbytes_per_token() == 2 * 2 * 8 * 4


@pytest.mark.parametrize("dtype, exc", [(np.float32, ValueError), (np.int16, ValueError), ("float64", ValueError),
                                        ("nope", TypeError), (3.5, TypeError)])
def test_bad_dtype_names_it(dtype, exc):
    with pytest.raises(exc, match=r"dtype: expected None, numpy.float16 or numpy.int8, got"):
        qkv.KVCache(dtype=dtype)


@pytest.mark.parametrize("dtype, value, match", [
    (np.int8, np.nan, r"key: expected finite values"), (np.float16, np.inf, r"key: expected finite values"),
    (np.float16, 1e5, r"key: expected finite values within float16's range .* got max \|x\| = 100000"),
    (np.int8, 1e10, r"key: expected finite values with max \|x\| ≤ 8.319\d*e\+06 per block of 32 .* got 1e\+10")])
def test_unstorable_rows_are_named_and_not_appended(dtype, value, match, rng):
    c = qkv.KVCache(dtype=dtype)
    c.append(np.ones((1, 1, 2, 8), np.float32), np.ones((1, 1, 2, 8), np.float32))
    k = np.ones((1, 1, 1, 8), np.float32)
    k[0, 0, 0, 3] = value
    with pytest.raises(ValueError, match=match):
        if np.isfinite(value):
            c.append(k, k.copy())
        else:                                                            # append's own check; reserve: at the read
            k_new, v_new = c.reserve(k.shape, k.shape, np.float32)
            k_new[...], v_new[...] = k, 1.0
            c.keys
    assert len(c) == 2 and c.keys.shape[2] == 2


# ---------------------------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("B, H, Hk, L, S", [(2, 6, 2, 1, 1), (2, 6, 2, 3, 17), (2, 9, 3, 1, 300), (2, 4, 4, 2, 4100),
                                            (2, 8, 1, 1, 300)])
def test_kernel_equals_float64_attention_over_the_dequantized_cache(dtype, B, H, Hk, L, S, rng):
    """Tight: float32 summation error (≤ 1e-6 · max|v̂|; measured ≤ 8.6e-8) against float64 attention over the
    cache's own (dequantized) keys and values. Loose, against float32 attention over the original keys and
    values: the storage's error (unit-normal keys and values; ≤ 1e-2 · max|v| for int8, measured ≤ 3.6e-3,
    and ≤ 1e-3 for float16, measured ≤ 3.8e-4: largest at S = 1, where the output is one stored value row)."""
    E = 64
    k = rng.standard_normal((B, Hk, S, E)).astype(np.float32)
    v = rng.standard_normal((B, Hk, S, E)).astype(np.float32)
    q = rng.standard_normal((B, H, L, E)).astype(np.float32)
    c = qkv.KVCache(dtype=dtype)
    c.append(k[:, :, :S // 2], v[:, :, :S // 2])
    c.append(k[:, :, S // 2:], v[:, :, S // 2:])
    out = kv_decode.decode(q, *c.storage(), len(c), 1 / math.sqrt(E), threads=2)
    assert out.dtype == np.float32 and out.shape == (B, H, L, E)
    ref = _reference(q, c.keys, c.values, 1 / math.sqrt(E))
    assert np.abs(out - ref).max() <= 1e-6 * np.abs(c.values).max()
    loose = 1e-2 if dtype == np.int8 else 1e-3
    assert np.abs(out - _reference(q, k, v, 1 / math.sqrt(E))).max() <= loose * np.abs(v).max()


@pytest.mark.parametrize("dtype", QDTYPES)
def test_cache_attention_kernel_and_numpy_fallback_agree(dtype, rng, monkeypatch):
    c = qkv.KVCache(dtype=dtype)
    c.append(_rows(rng, (1, 3, 70, 40), spread=False), _rows(rng, (1, 3, 70, 24), spread=False))
    q = rng.standard_normal((1, 9, 2, 40)).astype(np.float32)
    ref = _reference(q, c.keys, c.values, 0.3)
    assert kv_decode.available()
    fast = cache_attention(q, c, scale=0.3)                              # the kernel (E = 40: a block of 8)
    monkeypatch.setattr(kv_attention, "PARALLEL_MIN", 0)
    spread = cache_attention(q, c, scale=0.3)                            # the tasks on the runtime's threads
    from qkv.compute.kernels import KERNELS
    monkeypatch.setattr(KERNELS, "choice", "numpy")
    assert not kv_decode.available()
    slow = cache_attention(q, c, scale=0.3)                              # dequantized, the engine
    monkeypatch.setattr(KERNELS, "choice", "auto")
    monkeypatch.setattr(KERNELS, "_jit", False)                         # numba not installed
    assert not kv_decode.available()
    missing = cache_attention(q, c, scale=0.3)
    assert np.array_equal(spread, fast) and np.array_equal(missing, slow)
    for got in (fast, slow):
        assert np.abs(got - ref).max() <= 4e-6 * np.abs(c.values).max()
    monkeypatch.undo()
    long_q = rng.standard_normal((1, 9, DECODE_MAX_ROWS + 1, 40)).astype(np.float32)
    np.testing.assert_allclose(cache_attention(long_q, c, scale=0.3), _reference(long_q, c.keys, c.values, 0.3),
                               atol=4e-6 * np.abs(c.values).max())


def test_cache_attention_bad_input(rng):
    c = qkv.KVCache(dtype=np.int8)
    with pytest.raises(TypeError, match="cache: expected a qkv.KVCache, got list"):
        cache_attention(np.zeros((1, 1, 1, 8), np.float32), [])
    with pytest.raises(ValueError, match="cache: expected at least one token"):
        cache_attention(np.zeros((1, 1, 1, 8), np.float32), c)
    c.append(np.ones((1, 2, 3, 8), np.float32), np.ones((1, 2, 3, 8), np.float32))
    with pytest.raises(ValueError, match=r"query: expected \(B, H, L, E\) with B = 1, H a multiple of 2, L ≤ 3 "
                                         r"and E = 8 \(the cache's\), got \(1, 3, 1, 8\)"):
        cache_attention(np.zeros((1, 3, 1, 8), np.float32), c)
