"""qkv.models._quant.QuantMatrix: GGUF weight matrices kept as their blocks (F32, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).

Without gguf (tests/unit's packages): the blocks are random valid bytes (float16 scales finite, every other
byte random), dequantized here by a reference written from llama.cpp's ``dequantize_row_*`` loops (vectorized
over blocks, one weight position at a time, gguf's operation order). ``dequantize()`` must equal it bit for bit,
with numba's kernels and with the NumPy fallback; ``matmul(x)`` must equal ``x @ W.T`` computed in float64
within a float32 summation bound: |Δ| ≤ 2⁻²⁴ · 4√k · (|x|·|W|ᵀ) per output (k = the input width; measured
at most 0.1 of it). The comparison with gguf's own dequantize and SmolLM2's file is in
tests/integration/test_llama_quant.py.
"""
import dataclasses

import numpy as np
import pytest

from qkv.models import _quant
from qkv.models._quant import QuantMatrix, QuantStack, matmul, stack_rows

TYPES = ["F32", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
#: (out, in): SmolLM2's widths 576 and 1536 (the K-quants' 256-weight blocks: 512 and 1536), ragged outputs
SHAPES = {t: [(49, 512 if t.endswith("K") else 576), (577, 1536)] for t in TYPES}
ROWS = [1, 3, 17, 300]


def _halves(rng, shape):
    """Random finite float16 scales (some zero, some negative, some subnormal) as (…, 2) bytes."""
    h = rng.normal(0, 0.05, shape).astype(np.float16)
    flat = h.reshape(-1)
    flat[::7] = 0
    flat[3::11] = np.float16(3e-6)                                   # subnormal
    return h.view(np.uint8).reshape(shape + (2,))


def random_blocks(name, out, k, seed=0):
    """Valid random bytes (out, bytes per row) of type ``name``."""
    rng = np.random.default_rng(seed)
    if name == "F32":
        return rng.normal(size=(out, k)).astype(np.float32).view(np.uint8)
    _, bs, ts, _ = _quant.TYPES[name]
    nb = k // bs
    b = rng.integers(0, 256, (out, nb, ts), dtype=np.uint8)
    offsets = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[name]
    for o in offsets:
        b[..., o:o + 2] = _halves(rng, (out, nb))
    return b.reshape(out, nb * ts)


def _f16(b, o):
    return np.ascontiguousarray(b[..., o:o + 2]).view(np.float16)[..., 0].astype(np.float32)


def reference(name, data, k):
    """llama.cpp's dequantize_row_<type>, per weight position j of a block, over all blocks at once."""
    if name == "F32":
        return data.view(np.float32).copy()
    _, bs, ts, _ = _quant.TYPES[name]
    out = data.shape[0]
    b = data.reshape(out, k // bs, ts)
    y = np.empty((out, k // bs, bs), np.float32)
    if name in ("Q4_0", "Q4_1"):                                     # y[j] = x0·d (+ m), y[j + 16] = x1·d (+ m)
        d, qs = _f16(b, 0), b[..., 4:] if name == "Q4_1" else b[..., 2:]
        for j in range(16):
            x0, x1 = (qs[..., j] & 15).astype(np.int32), (qs[..., j] >> 4).astype(np.int32)
            if name == "Q4_0":
                y[..., j], y[..., j + 16] = d * (x0 - 8).astype(np.float32), d * (x1 - 8).astype(np.float32)
            else:
                m = _f16(b, 2)
                y[..., j], y[..., j + 16] = d * x0.astype(np.float32) + m, d * x1.astype(np.float32) + m
    elif name == "Q8_0":
        d = _f16(b, 0)
        for j in range(32):
            y[..., j] = b[..., 2 + j].view(np.int8).astype(np.float32) * d
    elif name == "Q4_K":
        d, dmin, sc = _f16(b, 0), _f16(b, 2), b[..., 4:16].astype(np.int32)
        for j in range(8):                                           # get_scale_min_k4
            if j < 4:
                s, m = sc[..., j] & 63, sc[..., j + 4] & 63
            else:
                s = (sc[..., j + 4] & 0xF) | ((sc[..., j - 4] >> 6) << 4)
                m = (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4)
            d1, m1 = d * s.astype(np.float32), dmin * m.astype(np.float32)
            q = b[..., 16 + 32 * (j // 2): 16 + 32 * (j // 2) + 32].astype(np.int32)
            q = q & 15 if j % 2 == 0 else q >> 4
            y[..., 32 * j: 32 * j + 32] = d1[..., None] * q.astype(np.float32) - m1[..., None]
    else:                                                            # Q6_K
        d = _f16(b, 208)
        for n in range(2):
            ql, qh, sc = b[..., 64 * n: 64 * n + 64], b[..., 128 + 32 * n: 160 + 32 * n], b[..., 192 + 8 * n:]
            for l in range(32):
                s = l // 16
                h = qh[..., l].astype(np.int32)
                lo, hi = ql[..., l].astype(np.int32), ql[..., l + 32].astype(np.int32)
                qs = [(lo & 15) | (((h >> 0) & 3) << 4), (hi & 15) | (((h >> 2) & 3) << 4),
                      (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | (((h >> 6) & 3) << 4)]
                for t, q in enumerate(qs):
                    scale = d * sc[..., s + 2 * t].view(np.int8).astype(np.float32)
                    y[..., 128 * n + l + 32 * t] = scale * (q - 32).astype(np.float32)
    return y.reshape(out, k)


def _same(a, b):
    """Equal bit for bit (so also in the sign of zeros)."""
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture
def no_numba(monkeypatch):
    """QuantMatrix on its NumPy fallback (as without the jit extra)."""
    monkeypatch.setattr(_quant, "_kernels", lambda: None)


def _matrix(name, out, k, seed=0):
    return QuantMatrix(random_blocks(name, out, k, seed), name, (out, k))


def _check_product(y, x, w):
    """|y − x·Wᵀ| ≤ 2⁻²⁴ · 4√k · (|x|·|W|ᵀ), the float32 summation bound (x·Wᵀ in float64)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    bound = 2.0 ** -24 * 4 * np.sqrt(x.shape[-1]) * (np.abs(x64) @ np.abs(w64).T)
    err = np.abs(y - x64 @ w64.T)
    worst = np.max(err / np.maximum(bound, 1e-300))
    assert y.dtype == np.float32 and np.all(err <= bound), f"worst {worst:.3g} × the bound"


# ---------------------------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("name", TYPES)
def test_dequantize_equals_llama_cpps_reference_bit_for_bit(name):
    for out, k in SHAPES[name]:
        data = random_blocks(name, out, k)
        w = QuantMatrix(data, name, (out, k)).dequantize()
        assert _same(w, reference(name, data, k)), (name, out, k)


@pytest.mark.parametrize("name", TYPES)
def test_numpy_fallback_dequantizes_the_same(name, no_numba):
    out, k = SHAPES[name][0]
    data = random_blocks(name, out, k, seed=1)
    assert _same(QuantMatrix(data, name, (out, k)).dequantize(), reference(name, data, k))


def test_half_conversion_without_f16c_is_exact_for_every_float16():
    jit = _quant._kernels()
    if jit is None:
        pytest.skip("numba is not installed")
    from numba import njit

    half = jit._half

    @njit
    def every():
        out = np.empty(65536, np.float32)
        for u in range(65536):
            out[u] = half(u & 255, u >> 8)
        return out
    got = every()
    want = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and _same(got[~nan], want[~nan])


# ---------------------------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("name", TYPES)
def test_matmul_is_x_times_the_dequantized_transpose(name):
    rng = np.random.default_rng(2)
    for out, k in SHAPES[name]:
        m = _matrix(name, out, k)
        w = m.dequantize()
        for n in ROWS:                                           # 1, 3: the one-pass kernel; 17, 300: bands
            x = rng.normal(size=(n, k)).astype(np.float32)
            _check_product(m.matmul(x), x, w)


@pytest.mark.parametrize("band_bytes", [1, 1_000_000])
def test_many_bands_with_a_ragged_last_one_give_the_product(band_bytes, monkeypatch):
    monkeypatch.setattr(_quant, "BAND_BYTES", band_bytes)        # bands of 16 or 162 rows (in = 1536)
    rng = np.random.default_rng(8)
    for name in ("Q8_0", "Q4_K"):
        out, k = SHAPES[name][1]                                 # 577 rows: the last band is short
        m = _matrix(name, out, k)
        for n in (17, 80):                                       # 80: BLAS on its own threads
            x = rng.normal(size=(n, k)).astype(np.float32)
            _check_product(m.matmul(x), x, m.dequantize())


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_matmul_on_the_numpy_fallback(name, no_numba):
    rng = np.random.default_rng(3)
    out, k = SHAPES[name][1]
    m = _matrix(name, out, k)
    for n in (1, 17):
        x = rng.normal(size=(n, k)).astype(np.float32)
        _check_product(m.matmul(x), x, reference(name, m.data, k))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_the_parallel_kernel_equals_the_one_thread_kernel(name, monkeypatch):
    if _quant._kernels() is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(4)
    out, k = SHAPES[name][1]
    m = _matrix(name, out, k)
    x = rng.normal(size=(3, k)).astype(np.float32)
    monkeypatch.setattr(_quant, "_threads", lambda: 2)
    two = m.matmul(x)
    monkeypatch.setattr(_quant, "_threads", lambda: 1)
    assert _same(two, m.matmul(x))                               # each output: the same sum in the same order


def test_matmul_shapes_and_out():
    rng = np.random.default_rng(5)
    m = _matrix("Q8_0", 49, 576)
    w = m.dequantize()
    v = rng.normal(size=576).astype(np.float32)
    assert m.matmul(v).shape == (49,)
    _check_product(m.matmul(v)[None], v[None], w)
    x3 = rng.normal(size=(2, 5, 576)).astype(np.float32)
    assert _same(m.matmul(x3), m.matmul(x3.reshape(10, 576)).reshape(2, 5, 49))
    out = np.empty((2, 5, 49), np.float32)
    assert m.matmul(x3, out=out) is out and _same(out, m.matmul(x3))
    wide = np.zeros((3, 60), np.float32)                         # a non-contiguous out
    got = m.matmul(x3[0, :3], out=wide[:, 5:54])
    assert _same(got, m.matmul(x3[0, :3])) and not wide[:, :5].any() and not wide[:, 54:].any()
    strided = x3[:, ::2].reshape(-1, 576)                        # x need not be contiguous
    _check_product(m.matmul(x3[:, ::2]).reshape(-1, 49), strided, w)


def test_matmul_errors_name_the_argument():
    m = _matrix("Q4_1", 49, 576)
    with pytest.raises(TypeError, match=r"x: expected float32, got float64"):
        m.matmul(np.zeros((1, 576)))
    with pytest.raises(ValueError, match=r"x: expected \(…, 576\), got \(1, 512\)"):
        m.matmul(np.zeros((1, 512), np.float32))
    with pytest.raises(ValueError, match=r"out: expected float32 \(1, 49\), got float32 \(1, 48\)"):
        m.matmul(np.zeros((1, 576), np.float32), out=np.empty((1, 48), np.float32))


# ---------------------------------------------------------------------------------------------- the class
def test_construction_checks_and_immutability():
    data = random_blocks("Q4_1", 4, 64)
    m = QuantMatrix(data, "Q4_1", (4, 64))
    assert m.qtype == "Q4_1" and m.shape == (4, 64) and m.nbytes == 4 * 40 and "Q4_1" in repr(m)
    assert QuantMatrix(data, 3, (4, 64)).qtype == "Q4_1"          # the ggml type id
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.qtype = "Q8_0"
    with pytest.raises(ValueError, match="read-only"):
        m.data[0, 0] = 1
    data[0, 0] ^= 1                                               # the caller's array stays theirs
    with pytest.raises(ValueError, match=r"qtype: expected one of \[.*'Q4_1'.*\], got 'Q5_0'"):
        QuantMatrix(data, "Q5_0", (4, 64))
    with pytest.raises(TypeError, match=r"qtype: expected a type name"):
        QuantMatrix(data, 3.0, (4, 64))
    with pytest.raises(ValueError, match=r"data: expected uint8 of shape \(4, 40\) \(Q4_1, shape \(4, 64\)\), "
                                         r"got uint8 \(4, 36\)"):
        QuantMatrix(data[:, :36], "Q4_1", (4, 64))
    with pytest.raises(ValueError, match=r"shape: Q4_K stores rows in blocks of 256 weights, got in = 576"):
        QuantMatrix(np.zeros((1, 324), np.uint8), "Q4_K", (1, 576))
    with pytest.raises(ValueError, match=r"shape: expected \(out, in\)"):
        QuantMatrix(data, "Q4_1", [4, 64])
    with pytest.raises(TypeError, match=r"data: expected a uint8 numpy array, got list"):
        QuantMatrix([[0] * 40] * 4, "Q4_1", (4, 64))


def test_permute_rows_take_and_stack():
    m = _matrix("Q4_K", 6, 256)
    w = m.dequantize()
    order = np.array([3, 0, 5, 1, 4, 2])
    assert _same(m.permute_rows(order).dequantize(), w[order])
    with pytest.raises(ValueError, match=r"order: expected a permutation of 0 … 5"):
        m.permute_rows([0, 0, 1, 2, 3, 4])
    ids = np.array([[5, 0], [2, 2]])
    assert _same(m.take(ids), w[ids]) and m.take(np.zeros((0,), int)).shape == (0, 256)
    a, b = _matrix("Q4_K", 6, 256, seed=1), _matrix("Q6_K", 3, 256, seed=2)
    same = stack_rows([m, a])
    assert isinstance(same, QuantMatrix) and _same(same.dequantize(), np.concatenate([w, a.dequantize()]))
    mixed = stack_rows([m, b])
    assert isinstance(mixed, QuantStack) and mixed.shape == (9, 256) and mixed.nbytes == m.nbytes + b.nbytes
    x = np.random.default_rng(6).normal(size=(2, 256)).astype(np.float32)
    assert _same(mixed.matmul(x), np.concatenate([m.matmul(x), b.matmul(x)], axis=1))
    assert _same(mixed.dequantize(), np.concatenate([w, b.dequantize()]))


def test_matmul_routes_float32_weights_to_qkv_gemm_and_quantized_to_their_kernels():
    m = _matrix("Q8_0", 49, 576)
    x = np.random.default_rng(7).normal(size=(3, 576)).astype(np.float32)
    wt = np.ascontiguousarray(m.dequantize().T)                  # qkv's (in, out) float32 layout
    assert _same(matmul(x, m), m.matmul(x))
    _check_product(matmul(x, wt), x, m.dequantize())
