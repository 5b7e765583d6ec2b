"""Products with 8-bit activations (:mod:`qkv.models._quant_q8`, ``load_llama(activations="int8")``), held to
llama.cpp's rules: the activations rounded as its x86 ``quantize_row_q8_1`` rounds them (scales stored as
float16), each Q4_1 / Q8_0 block's integer dot product scaled as its ``ggml_vec_dot_q4_1_q8_1`` /
``_q8_0_q8_0`` scale it (written out here in float64 from the blocks' bytes); the VNNI kernels and their
plain-loop twins give the same sums; the rows path (a prompt) rounds the activations the same way."""
import numpy as np
import pytest

pytest.importorskip("numba")
from qkv.models import _quant  # noqa: E402
from qkv.models import _quant_q8 as Q8  # noqa: E402
from qkv.models._quant import QuantMatrix  # noqa: E402
from test_quant import random_blocks  # noqa: E402

KERNELS = {"Q4_1": Q8.matvec_q4_1_q8, "Q8_0": Q8.matvec_q8_0_q8}
LOOPS = {"Q4_1": Q8._dot_q4_1_loops, "Q8_0": Q8._dot_q8_0_loops}


def llama_quantize(x):
    """llama.cpp's x86 quantize_row_q8_1 in NumPy float32: (q int8, f16(d), f16(d·Σq)) per block of 32."""
    b = x.reshape(-1, 32)
    a = np.abs(b).max(axis=1, keepdims=True)
    d = a / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(a != 0, np.float32(127.0) / a, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv).astype(np.int32)
    return (q.reshape(-1).astype(np.int8), d[:, 0].astype(np.float16).astype(np.float32),
            (d[:, 0] * q.sum(axis=1).astype(np.float32)).astype(np.float16).astype(np.float32))


def llama_product(name, data, x):
    """Σ over blocks of llama.cpp's per-block formula, in float64 from the bytes (one row x)."""
    q, xd, xs = llama_quantize(x)
    qb = q.reshape(-1, 32).astype(np.float64)
    out = data.shape[0]
    if name == "Q4_1":
        b = data.reshape(out, -1, 20)
        d, m = (np.ascontiguousarray(b[..., o:o + 2]).view(np.float16)[..., 0].astype(np.float64) for o in (0, 2))
        w = np.concatenate([b[..., 4:] & 15, b[..., 4:] >> 4], axis=-1).astype(np.float64)
        return ((d * xd) * (w * qb).sum(-1) + m * xs).sum(-1)
    b = data.reshape(out, -1, 34)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float64)
    w = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float64)
    return ((d * xd) * (w * qb).sum(-1)).sum(-1)


def test_scales_round_to_float16_as_ieee():
    rng = np.random.default_rng(0)
    v = rng.normal(size=20000) * 10.0 ** rng.integers(-10, 6, 20000)
    edges = [0.0, -0.0, 65504, 65519.9, 65520, 1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 1 + 2.0**-11,
             1 + 3 * 2.0**-11, -(1 + 2.0**-11)]
    v = np.concatenate([v, edges]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = v.astype(np.float16).astype(np.float32)
    got = np.array([Q8.round_f16(t) for t in v], np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-6, 300.0])
def test_activations_round_as_llama_cpp(scale):
    rng = np.random.default_rng(int(scale * 1e6) % 97)
    x = (rng.normal(size=1536) * scale).astype(np.float32)
    x[::97] = np.float32(0.5) * scale                          # some ties of x · 127 / a
    xq, xd, xs = np.empty(1536, np.int8), np.empty(48, np.float32), np.empty(48, np.float32)
    Q8.quantize_q8(x, xq, xd, xs)
    q, d, s = llama_quantize(x)
    np.testing.assert_array_equal(xq, q)
    np.testing.assert_array_equal(xd, d)
    np.testing.assert_array_equal(xs, s)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(("out", "k"), [(49, 576), (577, 1536), (3, 32)])
def test_the_product_is_llama_cpps_block_formula(name, out, k):
    rng = np.random.default_rng(out + k)
    m = QuantMatrix(random_blocks(name, out, k, seed=out), name, (out, k))
    x = rng.normal(size=(2, k)).astype(np.float32)
    got = np.empty((2, out), np.float32)
    KERNELS[name](m.data, x, got, 2)
    for i in range(2):
        want = llama_product(name, m.data, x[i])
        w = np.abs(m.dequantize()).astype(np.float64)
        bound = 2e-7 * np.sqrt(k) * (w @ np.abs(x[i]).astype(np.float64)) + 1e-30
        assert (np.abs(got[i] - want) <= bound).all()
    if k >= 512:                                  # against the unrounded x: the 8-bit activations' error, small
        exact = x @ m.dequantize().T
        assert np.abs(got - exact).max() / np.abs(exact).max() < 0.02


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_the_plain_loops_give_the_vnni_kernels_sums(name):
    rng = np.random.default_rng(1)
    m = QuantMatrix(random_blocks(name, 300, 1536), name, (300, 1536))
    x = rng.normal(size=(1, 1536)).astype(np.float32)
    a, b = np.empty((1, 300), np.float32), np.empty((1, 300), np.float32)
    Q8.matvec_q8(_quant.TYPES[name][3], m.data, x, a, 2)
    Q8._build(LOOPS[name])(m.data, x, b, 1)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_a_block_of_zeros_quantizes_to_zeros():
    x = np.zeros(64, np.float32)
    x[32:] = np.linspace(-1, 1, 32)
    xq, xd, xs = np.empty(64, np.int8), np.empty(2, np.float32), np.empty(2, np.float32)
    Q8.quantize_q8(x, xq, xd, xs)
    assert xd[0] == 0 and (xq[:32] == 0).all() and xs[0] == 0
    assert xq[32] == -127 and xq[63] == 127 and xd[1] == np.float32(np.float16(1 / 127))


def test_the_rows_are_rounded_alike_with_and_without_numba():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(7, 576)).astype(np.float32) * np.logspace(-6, 2, 7, dtype=np.float32)[:, None]
    x[3, :32] = 0
    got = _quant.round_rows(x)
    q, d = zip(*[llama_quantize(r)[:2] for r in x])
    want = (np.stack(q).reshape(7, -1, 32) * np.stack(d)[..., None]).reshape(7, 576)
    np.testing.assert_array_equal(got, want)
    numpy_only = _quant._q8_kernels
    try:
        _quant._q8_kernels = lambda: None
        np.testing.assert_array_equal(_quant.round_rows(x), want)
    finally:
        _quant._q8_kernels = numpy_only


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_a_matrix_with_int8_activations_rounds_rows_and_prompts_alike(name):
    rng = np.random.default_rng(3)
    m = QuantMatrix(random_blocks(name, 200, 576), name, (200, 576), "int8")
    assert "int8" in repr(m) and m.with_activations("float32").activations == "float32"
    x = rng.normal(size=(9, 576)).astype(np.float32)
    few = np.concatenate([m.matmul(x[i:i + 3]) for i in range(0, 9, 3)])       # the kernels (≤ 4 rows)
    many = m.matmul(x)                                                           # the rows path: rounded, BLAS
    np.testing.assert_allclose(many, _quant.round_rows(x) @ m.dequantize().T, rtol=1e-5, atol=1e-4)
    # the two differ only by the sums' order and, for Q4_1, m·(f16(d·Σq) − f16(d)·Σq): far below 8-bit noise
    np.testing.assert_allclose(few, many, atol=2e-3 * np.abs(many).max())
    exact = x @ m.dequantize().T
    assert np.abs(few - exact).max() > 1e-4 * np.abs(exact).max()               # x was rounded


def test_int8_activations_are_checked():
    data = random_blocks("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="activations: 'int8' multiplies"):
        QuantMatrix(data, "Q4_K", (4, 256), "int8")
    with pytest.raises(ValueError, match="activations: expected one of"):
        QuantMatrix(random_blocks("Q4_1", 4, 32), "Q4_1", (4, 32), "int4")
