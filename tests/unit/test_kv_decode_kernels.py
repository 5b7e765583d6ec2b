"""The decode kernels a compiled decoding step calls (:func:`qkv.compute.kv_decode.step_kernels`): the attention
over a cache in runs of keys merged by their maxima, equal to float64 attention whatever the runs; the stores
of a new row, bit for bit :meth:`qkv.KVCache.append`'s; the cache's room for a kernel's rows
(:meth:`qkv.KVCache.reserve_stored`, :meth:`~qkv.KVCache.truncate`); the engine's workers holding numba to
their own thread."""
import math

import numpy as np
import pytest

import qkv
from qkv.compute import kv_decode

pytest.importorskip("numba")
from test_kv_quant import _reference, _rows  # noqa: E402

FORMATS = {"f32": None, "f16": np.float16, "int8": np.int8}


def _kernel_args(c: qkv.KVCache):
    """The cache's storage as the kernels read it (keys, values, key scales, value scales)."""
    return kv_decode.kernel_args(*c.storage())[1:]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(("L", "S"), [(1, 1), (1, 5), (3, 40), (1, 1000), (2, 700)])
@pytest.mark.parametrize("parts", [1, 2, 7, 16])
def test_runs_of_keys_merge_to_float64_attention(fmt, L, S, parts, rng):
    """Whatever the runs (more than keys, rows that see none of a run's keys), within float32 summation of
    float64 attention over the cache's own keys and values; peaked rows (scores up to ±60 apart) included."""
    E, Hk, H = 64, 3, 9
    c = qkv.KVCache(dtype=FORMATS[fmt])
    c.append(_rows(rng, (1, Hk, S, E)), rng.standard_normal((1, Hk, S, E)).astype(np.float32))
    q = rng.standard_normal((1, H, L, E)).astype(np.float32)
    out = np.empty((1, H, L, E), np.float32)
    decode, _ = kv_decode.step_kernels(fmt)
    scale = np.float32(1 / math.sqrt(E))
    decode(q * scale, *_kernel_args(c), S, out, 32, parts)
    want = _reference(q, c.keys, c.values, float(scale))
    top = np.abs(np.einsum("bhle,bhse->bhls", q, np.repeat(c.keys, H // Hk, axis=1))).max() * scale  # max |s|
    # float32 rounds a score s by up to 2⁻²⁴·|s|, and e^s by that relatively: the keys' spread makes |s| ~ 10³
    assert np.abs(out - want).max() <= (1e-6 + 2 * 2.0**-24 * top) * np.abs(c.values).max()


def test_the_library_picks_more_runs_at_longer_contexts():
    assert kv_decode.parts(1) == kv_decode.parts(kv_decode.PART_KEYS - 1) == 1
    assert kv_decode.parts(4 * kv_decode.PART_KEYS) == 4
    assert kv_decode.parts(10 ** 6) == 16


@pytest.mark.parametrize("fmt", ["f16", "int8"])
@pytest.mark.parametrize("E", [64, 40])
def test_a_stored_row_is_the_caches_own_bit_for_bit(fmt, E, rng):
    _, store = kv_decode.step_kernels(fmt)
    for i in range(300):
        x = (rng.standard_normal(E) * 10.0 ** rng.uniform(-9, 3)).astype(np.float32)
        if i % 7 == 0:
            x[:min(32, E)] = 0
        c = qkv.KVCache(dtype=FORMATS[fmt])
        c.append(x.reshape(1, 1, 1, E), x.reshape(1, 1, 1, E))
        k, _, ks, _ = _kernel_args(c)
        dst = np.zeros_like(k[0, 0, 0])
        scales = np.zeros(-(-E // 32), np.uint16)
        assert store(x, dst, scales, 32)
        np.testing.assert_array_equal(dst, k[0, 0, 0])
        if fmt == "int8":
            np.testing.assert_array_equal(scales, ks[0, 0, 0])


@pytest.mark.parametrize(("fmt", "value"), [("f16", 7e4), ("f16", np.nan), ("f16", -np.inf), ("int8", np.nan),
                                            ("int8", np.inf), ("int8", 1e8)])
def test_a_row_the_format_cannot_hold_is_refused(fmt, value):
    _, store = kv_decode.step_kernels(fmt)
    x = np.ones(64, np.float32)
    x[50] = value
    dst = np.zeros(64, np.uint16 if fmt == "f16" else np.int8)
    assert not store(x, dst, np.zeros(2, np.uint16), 32)
    with pytest.raises(ValueError, match="key: expected finite"):
        qkv.KVCache(dtype=FORMATS[fmt]).append(x.reshape(1, 1, 1, 64), x.reshape(1, 1, 1, 64))


@pytest.mark.parametrize("dtype", [None, np.float16, np.int8])
def test_room_for_a_kernels_rows_and_taking_tokens_back(dtype, rng):
    c = qkv.KVCache(dtype=dtype)
    assert c.row_dtype is None
    x = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    c.append(x, x)
    k, v, ks, vs = c.reserve_stored((1, 2, 1, 8), (1, 2, 1, 8), np.float32)
    assert c.offset == 6 and c.row_dtype == np.float32 and k.shape[2] >= 6
    assert k is c.storage()[0] and (ks is None) == (dtype != np.int8)
    ref = qkv.KVCache(dtype=dtype)
    ref.append(x, x)
    ref.append(x[:, :, :1], x[:, :, :1])
    k[:, :, 5], v[:, :, 5] = ref.storage()[0][:, :, 5], ref.storage()[1][:, :, 5]        # the kernel's writes
    if ks is not None:
        ks[:, :, 5], vs[:, :, 5] = ref.storage()[2][:, :, 5], ref.storage()[3][:, :, 5]
    np.testing.assert_array_equal(c.keys, ref.keys)
    c.truncate(3)
    assert c.offset == 3
    np.testing.assert_array_equal(c.values, ref.values[:, :, :3])
    c.reserve((1, 2, 2, 8), (1, 2, 2, 8), np.float32)                 # pending rows (quantized caches) …
    c.truncate(4)                                                      # … cut with the rest
    assert c.offset == 4 and c.keys.shape[2] == 4
    with pytest.raises(ValueError, match=r"length: expected 0 … 4 \(the cached tokens\), got 5"):
        c.truncate(5)
    with pytest.raises(TypeError, match="length: expected an int, got float"):
        c.truncate(1.0)
    with pytest.raises(TypeError, match=r"key: expected dtype float32 \(as the cached tokens\), got float64"):
        c.reserve_stored((1, 2, 1, 8), (1, 2, 1, 8), np.float64)


def test_the_engines_workers_run_numba_kernels_on_their_own_thread():
    import numba

    from qkv.compute.kernels import KERNELS
    from qkv.engine.backends.runtime import RUNTIME

    def task(_):
        KERNELS.jit()                      # what a kernel's caller does first (sets it where the pool predates numba)
        return numba.get_num_threads()
    counts = list(RUNTIME.pool(2).map(task, range(4)))
    assert counts == [1, 1, 1, 1] and numba.get_num_threads() >= 1


@pytest.mark.parametrize("fmt", ["f16", "int8"])
def test_subnormal_float16_numbers_and_scales_are_read_exactly(fmt):
    """float16 below 6.1e-5 (subnormal: multiples of 2⁻²⁴), as values and as int8's scales: one key, so the
    output is its value row as stored."""
    v = (np.arange(1, 65, dtype=np.float32) * np.float32(2.0 ** -24)).reshape(1, 1, 1, 64)
    c = qkv.KVCache(dtype=FORMATS[fmt])
    c.append(np.zeros((1, 1, 1, 64), np.float32), v)
    out = np.empty((1, 1, 1, 64), np.float32)
    decode, _ = kv_decode.step_kernels(fmt)
    decode(np.zeros((1, 1, 1, 64), np.float32), *_kernel_args(c), 1, out, 32, 1)
    np.testing.assert_array_equal(out, c.values)
    if fmt == "f16":
        np.testing.assert_array_equal(out, v)
