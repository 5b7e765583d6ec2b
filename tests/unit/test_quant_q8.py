"""Q4_1 products with 8-bit activations (:mod:`qkv.models._quant_q8`, ``load_llama(activations="int8")``):
the VNNI kernel and its plain-loop twin give the same integer sums, and the product is the float32 product up to
the activations' rounding to 8 bits per block of 32."""
import numpy as np
import pytest

pytest.importorskip("numba")
from qkv.models import _quant_q8 as Q8  # noqa: E402
from qkv.models._quant import QuantMatrix  # noqa: E402
from test_quant import random_blocks  # noqa: E402


@pytest.mark.parametrize(("out", "k"), [(49, 576), (577, 1536), (3, 32)])
def test_the_product_is_the_float32_product_up_to_the_activations_rounding(out, k):
    rng = np.random.default_rng(out)
    m = QuantMatrix(random_blocks("Q4_1", out, k), "Q4_1", (out, k))
    w = m.dequantize().astype(np.float64)
    x = rng.normal(size=(1, k)).astype(np.float32)
    got = np.empty((1, out), np.float32)
    Q8.matvec_q4_1_q8(m.data, x, got, 2)
    xq, xd, xs = np.empty(k, np.int8), np.empty(k // 32, np.float32), np.empty(k // 32, np.float32)
    Q8.quantize_q8(x[0], xq, xd, xs)
    x8 = (xq.reshape(-1, 32) * xd[:, None]).reshape(1, k).astype(np.float64)        # x as rounded
    assert np.abs(x8 - x).max() <= xd.max() / 2 * (1 + 1e-6)                          # round to nearest
    want = x8 @ w.T                                                                   # the same x, in float64
    bound = 4e-7 * np.sqrt(k) * (np.abs(x8) @ np.abs(w).T) + 1e-6 * np.abs(w).max()   # sums, d·d_x, m·s_x
    assert (np.abs(got - want) <= bound).all()
    if k >= 512:                                  # against the unrounded x: the 8-bit activations' error, small
        rel = np.abs(got - x @ m.dequantize().T).max() / np.abs(x @ m.dequantize().T).max()   # over many blocks
        assert rel < 0.02


def test_the_plain_loops_give_the_vnni_kernels_sums():
    rng = np.random.default_rng(1)
    m = QuantMatrix(random_blocks("Q4_1", 300, 1536), "Q4_1", (300, 1536))
    x = rng.normal(size=(1, 1536)).astype(np.float32)
    a, b = np.empty((1, 300), np.float32), np.empty((1, 300), np.float32)
    Q8.matvec_q4_1_q8(m.data, x, a, 2)
    Q8._build(Q8._dot_loops)(m.data, x, b, 1)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_a_block_of_zeros_quantizes_to_zeros():
    x = np.zeros(64, np.float32)
    x[32:] = np.linspace(-1, 1, 32)
    xq, xd, xs = np.empty(64, np.int8), np.empty(2, np.float32), np.empty(2, np.float32)
    Q8.quantize_q8(x, xq, xd, xs)
    assert xd[0] == 0 and (xq[:32] == 0).all() and xs[0] == 0
    assert xq[32] == -127 and xq[63] == 127 and xd[1] == np.float32(1 / 127)
