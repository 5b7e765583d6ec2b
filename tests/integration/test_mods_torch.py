"""The tests of tests/unit/test_mods.py that need torch or transformers."""

import numpy as np
import pytest

from qkv import mods


# ============================================================================================ score mods
def _bloom_slopes(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    torch = pytest.importorskip("torch")
    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float64)   # (H, 1, 2)
    return alibi[:, 0, 1].numpy()                 # slope × position 1


@pytest.mark.parametrize("H", [6, 8, 12, 16])
def test_alibi_slopes_equal_bloom(H):
    pytest.importorskip("transformers")
    np.testing.assert_allclose(mods.alibi_slopes(H), _bloom_slopes(H), rtol=1e-6)    # BLOOM: float32 powers
