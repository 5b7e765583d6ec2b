"""Sinusoidal positions, token embeddings, and seed 000's whole path against torch."""
import math

import numpy as np
import pytest

import qkv


def test_sinusoidal_positions_formula():
    pe = qkv.sinusoidal_positions(50, 16, dtype=np.float64)
    assert pe.shape == (50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert pe[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-12)
            assert pe[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-12)
    # hand-checked: PE[1, 0] = sin(1) = 0.84147, PE[1, 1] = cos(1) = 0.54030, PE[0] = [0, 1, 0, 1, ...]
    assert pe[1, 0] == pytest.approx(0.841471, abs=1e-6) and pe[1, 1] == pytest.approx(0.540302, abs=1e-6)
    np.testing.assert_array_equal(pe[0], np.tile([0.0, 1.0], 8))


def test_odd_width_ends_with_sine():
    pe = qkv.sinusoidal_positions(4, 5, dtype=np.float64)
    assert pe.shape == (4, 5)
    assert pe[3, 4] == pytest.approx(math.sin(3 / 10000 ** (4 / 5)))


def test_token_embedding_lookup_plus_positions():
    emb = qkv.TokenEmbedding(10, 4, seed=0)
    x = emb.embed([3, 1, 3], positions=False)
    np.testing.assert_array_equal(x, emb.weight[[3, 1, 3]])
    y = emb([3, 1, 3])
    np.testing.assert_allclose(y, x + qkv.sinusoidal_positions(3, 4))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: qkv.sinusoidal_positions(0, 4), ValueError, "seq_len"),
    (lambda: qkv.sinusoidal_positions(3, 2.0), TypeError, "d_model"),
    (lambda: qkv.TokenEmbedding(10, 4).embed([1, 10]), ValueError, r"ids: expected ids in \[0, 10\), got 10"),
    (lambda: qkv.TokenEmbedding(10, 4).embed([1.0]), TypeError, "ids"),
    (lambda: qkv.TokenEmbedding(10, 4).embed([]), ValueError, "ids"),
    (lambda: qkv.TokenEmbedding(10, 4, weight=np.zeros((9, 4))), ValueError, r"weight: expected shape \(10, 4\)"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
