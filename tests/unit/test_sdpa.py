"""qkv.scaled_dot_product_attention against torch's SDPA, over many random configurations."""
import math

import numpy as np

import qkv


def test_dropout_is_reproducible_and_matches_its_weights(rng):
    q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
    a, wa = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(7),
                                             return_weights=True)
    b = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, wa @ v, atol=1e-12)            # the weights returned are the ones applied
    kept = wa[wa > 0]
    plain = qkv.scaled_dot_product_attention(q, k, v, return_weights=True)[1]
    np.testing.assert_allclose(kept, 2 * plain[wa > 0], atol=1e-12)  # kept weights scaled by 1/(1-p)
    assert 0 < np.count_nonzero(wa) < wa.size
    zero = qkv.scaled_dot_product_attention(q, k, v, dropout_p=1.0, rng=np.random.default_rng(0))
    assert np.all(zero == 0)


def test_lists_are_accepted_as_float64():
    out = qkv.scaled_dot_product_attention([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0], [0.0]])
    assert out.dtype == np.float64
    w = np.exp([1 / math.sqrt(2), 0]) / np.exp([1 / math.sqrt(2), 0]).sum()
    np.testing.assert_allclose(out, [[w[0]]])


def test_attention_with_extents_takes_the_callers_extents_and_equals_sdpa(rng, monkeypatch):
    """qkv.sdpa.attention_with_extents: the caller's max |x| stands for the checks' own passes — the same output
    as scaled_dot_product_attention and no max over the inputs; an extent too large for the rough bound has the
    checks read the rows' norms, as a read one would."""
    from qkv import sdpa

    q, k, v = (rng.standard_normal((2, 3, 40, 8)).astype(np.float32) for _ in range(3))
    ext = {n: float(np.abs(a).max()) for n, a in (("query", q), ("key", k), ("value", v))}
    want = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    reads = []
    real_max = np.max
    monkeypatch.setattr(np, "max", lambda a, *x, **kw: (reads.append(a.shape), real_max(a, *x, **kw))[1])
    got = sdpa.attention_with_extents(q, k, v, ext, is_causal=True)
    monkeypatch.setattr(np, "max", real_max)
    assert not [r for r in reads if r == q.shape]
    np.testing.assert_array_equal(got, want)
    big = sdpa.attention_with_extents(q, k, v, dict(ext, query=1e20, key=1e20), is_causal=True)
    np.testing.assert_array_equal(big, want)       # a rough bound past float32's: the rows' norms read, as ever
