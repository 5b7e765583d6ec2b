"""The tests of tests/unit/test_masks.py that need torch or transformers."""
import numpy as np
import pytest

import qkv
from qkv import masks


def test_causal_matches_torch_is_causal():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((5, 8)), rng.standard_normal((7, 8)), rng.standard_normal((7, 3))
    want = torch.nn.functional.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), is_causal=True)
    got = qkv.scaled_dot_product_attention(q, k, v, masks.causal(5, 7))
    np.testing.assert_allclose(got, want.numpy(), atol=1e-12)
