"""The tests of tests/unit/test_bad_input.py that need torch or transformers."""
import numpy as np
import pytest

import qkv
from test_bad_input import m  # noqa: E402,F401  (its helpers, shared)


x = np.ones((2, 3, 8), np.float32)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: qkv.MultiHeadAttention(10, 3), ValueError, r"embed_dim \(10\) is not a multiple of num_heads \(3\)"),
    (lambda: qkv.MultiHeadAttention(8, 4, num_kv_heads=3), ValueError,
     r"num_heads \(4\) is not a multiple of num_kv_heads \(3\)"),
    (lambda: qkv.MultiHeadAttention(0, 1), ValueError, r"embed_dim: expected an integer >= 1, got 0"),
    (lambda: qkv.MultiHeadAttention(8, 2, dtype=np.int32), TypeError, r"dtype: expected a float dtype \(float16"),
    (lambda: qkv.MultiHeadAttention(8, 2, batch_first="yes"), TypeError, r"batch_first: expected True or False"),
    (lambda: m(np.ones((2, 3, 7), np.float32)), ValueError, r"query: expected last dimension 8, got 7"),
    (lambda: m(np.ones((2, 3, 4, 8), np.float32)), ValueError, r"query: expected shape \(B, T, 8\)"),
    (lambda: m(x, key_mask=np.ones((2, 3))), TypeError, r"key_mask: expected a bool array"),
    (lambda: m(x, key_mask=np.ones((2, 4), bool)), ValueError, r"key_mask: expected shape \(2, 3\), got \(2, 4\)"),
    (lambda: m(x, attn_mask=np.ones((3, 4), bool)), ValueError, r"attn_mask: shape \(3, 4\) does not broadcast"),
    (lambda: m(x, np.ones((3, 3, 8), np.float32)), ValueError, r"key: expected batch size 2"),
    (lambda: m(x, need_weights=None), TypeError, r"need_weights: expected True or False"),
    (lambda: m.load(W_Q=np.ones((8, 7))), ValueError, r"W_Q: expected shape \(8, 8\), got \(8, 7\)"),
    (lambda: m.load(W_X=np.ones((8, 8))), ValueError, r"W_X: not a weight"),
    (lambda: qkv.MultiHeadAttention.from_torch("module"), TypeError, r"module: expected a torch.nn.MultiheadAttention"),
])
def test_mha_bad_input(call, exc, pattern):
    if "from_torch" in repr(call.__code__.co_names):
        pytest.importorskip("torch")
    with pytest.raises(exc, match=pattern):
        call()
