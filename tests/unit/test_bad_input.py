"""Each kind of bad input gets a ValueError/TypeError that names the argument and shows expected vs actual."""
import numpy as np
import pytest

import qkv
from qkv.merge import merge_partials

r = np.random.default_rng(0)
q = r.standard_normal((2, 4, 3, 8))
k = r.standard_normal((2, 4, 5, 8))
v = r.standard_normal((2, 4, 5, 6))
SDPA = qkv.scaled_dot_product_attention


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: SDPA("q", k, v), TypeError, r"query: expected a numpy.ndarray, got str"),
    (lambda: SDPA(q.astype(int), k, v), TypeError, r"query: expected dtype float16, float32 or float64, got int64"),
    (lambda: SDPA(q, k.astype(np.float32), v), TypeError, r"one dtype, got float64, float32, float64"),
    (lambda: SDPA(q[0, 0, 0], k, v), ValueError, r"query: expected at least 2 dimensions, got 1"),
    (lambda: SDPA(q, k[..., :7], v), ValueError, r"key: expected last dimension E=8 .* got 7"),
    (lambda: SDPA(q, k, v[..., :4, :]), ValueError, r"value: expected 5 rows \(one per key\), got 4"),
    (lambda: SDPA(q, k[:, :3], v[:, :3]), ValueError, r"key: leading dimensions \(2, 3\) do not broadcast"),
    (lambda: SDPA(q, k[:, :2], v[:, :2]), ValueError, r"enable_gqa=True"),
    (lambda: SDPA(q, k[:, :3], v[:, :3], enable_gqa=True), ValueError,
     r"number of query heads \(4\) must be a multiple of the number of key/value heads \(3\)"),
    (lambda: SDPA(np.full_like(q, np.nan), k, v), ValueError, r"query: expected finite numbers, got nan"),
    (lambda: SDPA(q, k, np.full_like(v, np.inf)), ValueError, r"value: expected finite numbers, got inf"),
    (lambda: SDPA(q, k, v, np.ones((3, 5), np.int64)), TypeError, r"attn_mask: expected dtype bool"),
    (lambda: SDPA(q, k, v, np.ones((3, 4), bool)), ValueError,
     r"attn_mask: shape \(3, 4\) does not broadcast to the scores' shape \(2, 4, 3, 5\)"),
    (lambda: SDPA(q, k, v, np.ones((3, 2, 4, 3, 5), bool)), ValueError, r"attn_mask: shape"),
    (lambda: SDPA(q, k, v, np.full((3, 5), np.nan)), ValueError, r"attn_mask: .*NaN"),
    (lambda: SDPA(q, k, v, np.ones((3, 5), bool), is_causal=True), ValueError,
     r"attn_mask: expected None when is_causal=True"),
    (lambda: SDPA(q, k, v, is_causal=1), TypeError, r"is_causal: expected True or False, got int"),
    (lambda: SDPA(q, k, v, dropout_p=1.5), ValueError, r"dropout_p: expected a number in \[0, 1\], got 1.5"),
    (lambda: SDPA(q, k, v, dropout_p=0.1, rng=42), TypeError, r"rng: expected a numpy.random.Generator"),
    (lambda: SDPA(q, k, v, scale=float("inf")), ValueError, r"scale: expected a finite number"),
    (lambda: SDPA(q, k, v, scale="2"), ValueError, r"scale: expected a finite number"),
    (lambda: SDPA(np.zeros((2, 0, 8)), k[0], v[0]), ValueError, r"query: expected no empty dimension"),
])
def test_sdpa_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


X = np.ones((3, 4))
W = np.ones((4, 3))


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: qkv.attention(X, np.ones((5, 3)), W, W), ValueError, r"w_q: expected 4 rows \(the width of x\)"),
    (lambda: qkv.attention(X, W, np.ones((4, 2)), W), ValueError, r"w_k: expected 3 columns"),
    (lambda: qkv.attention(X, W, W, W, x_kv=np.ones((2, 5))), ValueError, r"w_k: expected 5 rows \(the width of x_kv\)"),
    (lambda: qkv.attention(X, W[0], W, W), ValueError, r"w_q: expected 2 dimensions, got 1"),
    (lambda: qkv.attention([[1, "a"]], W, W, W), TypeError, r"x: expected a numeric array"),
])
def test_attention_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


m = qkv.MultiHeadAttention(8, 2, seed=0)


def test_no_bare_asserts_in_the_package():
    """User input is never checked with assert (it vanishes under python -O)."""
    import pathlib
    import re
    src = pathlib.Path(qkv.__file__).parent
    offenders = [f"{p.relative_to(src)}:{n}" for p in src.rglob("*.py")
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if re.match(r"\s*assert\b", line)]
    assert offenders == []


# ------------------------------------------------------------------------- finite input that a cast would break
# float64 values beyond float32 (or float16) are finite as given and inf after the cast: each is refused
# where it enters, naming the argument, instead of a NaN (or a silently different result) later.
_q32 = np.ones((1, 2, 4, 8), np.float32)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: SDPA(_q32, _q32, _q32, np.full((4, 4), 1e39)), ValueError,
     r"attn_mask: expected values up to 1.7e\+38 \(half of float32's largest number.*got 1e\+39 at index \(0, 0\)"),
    (lambda: qkv.attention_weights(_q32, _q32, [0], attn_mask=np.full((4, 4), 1e39)), ValueError, r"attn_mask: "),
    (lambda: qkv.scaled_dot_product_attention_backward(_q32, _q32, _q32, _q32, attn_mask=np.full((4, 4), 1e39)),
     ValueError, r"attn_mask: "),
    (lambda: qkv.MultiHeadAttention(8, 2).load(W_Q=np.full((8, 8), 1e39)), ValueError,
     r"W_Q: expected values within float32's range"),
    (lambda: qkv.flex_attention(_q32, _q32, _q32, sink_logits=np.full(2, 1e39)), ValueError,
     r"sink_logits: expected logits within ±1e30, got 1e\+39"),
    (lambda: qkv.mods.softcap(1e-300), ValueError, r"cap: expected a number in \[1e-30, 1e30\]"),
    (lambda: qkv.mods.softcap(1e308), ValueError, r"cap: expected a number in \[1e-30, 1e30\]"),
    (lambda: qkv.positions.rope(np.full((2, 4), 60000, np.float16)), ValueError,
     r"x: values up to 60000 may rotate to 84852.8, beyond float16's largest number 65504"),
    (lambda: qkv.positions.rope(np.full((2, 4), np.nan, np.float32)), ValueError, r"x: expected finite numbers"),
    (lambda: qkv.flex_attention(_q32, _q32, _q32, score_mod=qkv.mods.alibi([0.5, 1.0, 7.0])), ValueError,
     r"slopes: expected one slope per query head \(H=2\), got 3"),
    (lambda: qkv.sinusoidal_positions(4, 4, base=0), ValueError, r"base: expected a finite number > 0, got 0"),
    (lambda: qkv.sinusoidal_positions(4, 4, base=float("nan")), ValueError, r"base: expected a finite number"),
    (lambda: qkv.sinusoidal_positions(4, 4, base="x"), TypeError, r"base: expected a positive real number, got str"),
    (lambda: qkv.sinusoidal_positions(4, 4, dtype=np.int32), TypeError,
     r"dtype: expected a float dtype \(float16, float32 or float64\), got int32"),
    (lambda: qkv.sinusoidal_positions(4, 4, dtype="bogus"), TypeError, r"dtype: expected a float dtype.*'bogus'"),
    (lambda: qkv.masks.to_additive(np.ones((2, 2), bool), dtype=np.int32), TypeError, r"dtype: expected a float"),
    (lambda: qkv.MultiHeadAttention(8, 2, seed=-1), ValueError, r"seed: expected None or an integer >= 0, got -1"),
    (lambda: qkv.MultiHeadAttention(8, 2, seed="x"), TypeError, r"seed: expected None or an integer >= 0, got str"),
    (lambda: qkv.MultiHeadAttention(8, 2, dtype="bogus"), TypeError, r"dtype: expected a float dtype"),
    (lambda: qkv.positions.TokenEmbedding(10, 4, seed=-1), ValueError, r"seed: expected None or an integer"),
    (lambda: qkv.positions.TokenEmbedding(10, 4, dtype=np.int32), TypeError, r"dtype: expected a float dtype"),
    (lambda: qkv.attention(np.full((3, 4), 1e30, np.float32), *[np.full((4, 3), 1e30, np.float32)] * 3),
     ValueError, r"x, w_q: Q = x · w_q overflowed float32 \(got inf\)"),
    (lambda: qkv.attention_weights(_q32, _q32, 10**30), ValueError,
     r"rows: expected indices in \[-4, 4\) \(there are L=4 queries\), got 10{30}"),
    (lambda: merge_partials(_q32, _q32[..., 0], _q32, _q32[..., 0], out="x"), TypeError,
     r"out: expected a pair \(out_array, lse_array\) of numpy arrays, got str"),
])
def test_values_a_cast_or_a_bad_setting_would_break_are_refused(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("call, pattern", [
    (lambda: qkv.sinusoidal_positions(10**12, 8), r"seq_len × d_model: needs about [\d,.]+ GiB, more than"),
    (lambda: qkv.masks.causal(10**7, 10**7), r"q_len × k_len: needs about"),
    (lambda: qkv.masks.sliding_window(10**7, 10**7, window=4), r"q_len × k_len: needs about"),
    (lambda: qkv.create_block_mask(qkv.mods.causal(), None, None, 10**12, 10**12),
     r"B × H × Q_LEN × KV_LEN / BLOCK_SIZE²: needs about"),
])
def test_sizes_beyond_memory_are_a_value_error_not_a_memory_error(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_the_limits_leave_ordinary_values_alone():
    m = np.array([[np.finfo(np.float32).min, 0.0, 0.0, 0.0]] * 4)       # HF's "masked" value: allowed
    out = SDPA(_q32, _q32, _q32, m)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(qkv.mods.alibi([0.5, 0.25]).params["slopes"], [0.5, 0.25])
    assert qkv.sinusoidal_positions(3, 4, base=2.0, dtype=np.float64).dtype == np.float64
    assert qkv.MultiHeadAttention(8, 2, seed=np.random.default_rng(1)).W_Q.shape == (8, 8)
