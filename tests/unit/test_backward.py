"""qkv.scaled_dot_product_attention_backward against torch autograd through SDPA."""

import numpy as np
import pytest

import qkv
from qkv.backends import tiled


@pytest.fixture(autouse=True)
def _parallel_even_when_small(monkeypatch):
    """Small test sizes would run on one thread (SERIAL_BELOW_FLOPS) and, through the public function, on
    whole arrays (BACKWARD_WHOLE_SCORES); these tests want the tiled engine and its pool."""
    with tiled.limits(serial_below_flops=0, backward_whole_scores=0):
        yield


def test_threads_do_not_change_gradients(rng):
    q, k, v, go = (rng.standard_normal((1, 1, 90, 8)).astype(np.float32) for _ in range(4))
    base = tiled.backward(go, q, k, v, scale=0.3, threads=1, block_q=16, block_k=16)
    for n in (2, 4):
        for g, b in zip(tiled.backward(go, q, k, v, scale=0.3, threads=n, block_q=16, block_k=16), base):
            np.testing.assert_allclose(g, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(grad_out=np.zeros((2, 5, 3))), ValueError, "grad_out"),
    (dict(grad_out=np.zeros((2, 5, 4), np.float32)), TypeError, "grad_out"),
    (dict(grad_out="x"), TypeError, "grad_out"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(scale=float("nan")), ValueError, "scale"),
])
def test_backward_bad_input(kwargs, err, match):
    q = np.zeros((2, 5, 4))
    args = dict(grad_out=np.zeros((2, 5, 4)), query=q, key=q, value=q)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        qkv.scaled_dot_product_attention_backward(**args)
