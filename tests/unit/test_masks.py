"""qkv.masks: every builder returns bool, True = may attend."""
import numpy as np
import pytest

import qkv
from qkv import masks


def test_causal_top_left_is_lower_triangle():
    m = masks.causal(3, 5)
    assert m.dtype == np.bool_
    np.testing.assert_array_equal(m, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(masks.causal(4), np.tril(np.ones((4, 4), bool)))


def test_causal_bottom_right_aligns_last_query_with_last_key():
    np.testing.assert_array_equal(masks.causal(3, 5, align="bottom-right"),
                                  [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # more queries than keys: the first L - S rows see nothing
    np.testing.assert_array_equal(masks.causal(3, 2, align="bottom-right"), [[0, 0], [1, 0], [1, 1]])


def test_sliding_window():
    np.testing.assert_array_equal(masks.sliding_window(4, window=2),
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(masks.sliding_window(3, window=2, causal=False),
                                  [[1, 1, 0], [1, 1, 1], [0, 1, 1]])
    np.testing.assert_array_equal(masks.sliding_window(2, 4, window=1, align="bottom-right"),
                                  [[0, 0, 1, 0], [0, 0, 0, 1]])
    # a window as long as the sequence is plain causal
    np.testing.assert_array_equal(masks.sliding_window(6, window=6), masks.causal(6))


def test_padding_from_lengths_and_from_is_real():
    m = masks.padding([2, 3], max_len=4)
    assert m.shape == (2, 1, 1, 4) and m.dtype == np.bool_
    np.testing.assert_array_equal(m[:, 0, 0], [[1, 1, 0, 0], [1, 1, 1, 0]])
    is_real = np.array([[True, True, False], [True, False, False]])
    np.testing.assert_array_equal(masks.padding(is_real=is_real)[:, 0, 0], is_real)
    np.testing.assert_array_equal(masks.padding([1, 3])[:, 0, 0], [[1, 0, 0], [1, 1, 1]])


def test_combine_is_and_with_broadcasting():
    pad = masks.padding([2, 3])                       # (2, 1, 1, 3)
    both = masks.combine(masks.causal(3), pad, None)
    assert both.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(both[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 0]])
    assert masks.combine(None, None) is None


def test_to_additive():
    a = masks.to_additive(np.array([True, False]))
    assert a.dtype == np.float32 and a[0] == 0 and a[1] == -np.inf


def test_padding_mask_through_sdpa_ignores_padded_keys(rng):
    q = rng.standard_normal((2, 1, 3, 4))
    k = rng.standard_normal((2, 1, 5, 4))
    v = rng.standard_normal((2, 1, 5, 2))
    m = masks.padding([3, 5])
    out = qkv.scaled_dot_product_attention(q, k, v, m)
    trimmed = qkv.scaled_dot_product_attention(q[:1], k[:1, :, :3], v[:1, :, :3])
    np.testing.assert_allclose(out[:1], trimmed, atol=1e-12)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: masks.causal(0), ValueError, "q_len"),
    (lambda: masks.causal(2.5), TypeError, "q_len"),
    (lambda: masks.causal(2, 3, align="left"), ValueError, "align"),
    (lambda: masks.sliding_window(3, window=0), ValueError, "window"),
    (lambda: masks.padding(), ValueError, "exactly one"),
    (lambda: masks.padding([1, 2], is_real=np.ones((2, 2), bool)), ValueError, "exactly one"),
    (lambda: masks.padding([1.5]), TypeError, "lengths"),
    (lambda: masks.padding([3], max_len=2), ValueError, "max_len"),
    (lambda: masks.padding([-1]), ValueError, "non-negative"),
    (lambda: masks.padding(is_real=np.ones((2, 2))), TypeError, "is_real"),
    (lambda: masks.combine(np.ones((2, 2))), TypeError, "bool"),
    (lambda: masks.combine(np.ones((2, 2), bool), np.ones((3, 3), bool)), ValueError, "broadcast"),
    (lambda: masks.to_additive(np.ones(2)), TypeError, "bool"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
