"""The compiled decoding step's attention (:func:`qkv.compute.kv_decode.step_kernels`, the float32 cache's
kernel) against float64 NumPy: every query head over the first n cached keys, grouped-query heads, the cache
longer than n, in runs of keys as the step splits them."""
import numpy as np
import pytest

pytest.importorskip("numba")
from qkv.compute import kv_decode  # noqa: E402

DECODE, _ = kv_decode.step_kernels("f32")


def _attend(qkv, kc, vc, n, H, Hk, E, scale, out):
    """The step's call: q from row 0 of qkv, scaled, (1, H, 1, E); out (1, H·E)."""
    q = (qkv[0, :H * E] * np.float32(scale)).reshape(1, H, 1, E)
    o = np.empty((1, H, 1, E), np.float32)
    DECODE(q, *kv_decode.kernel_args(kc, vc, None, None)[1:], n, o, 32, kv_decode.parts(n))
    out[...] = o.reshape(1, H * E)


def _reference(qkv, kc, vc, n, H, Hk, E, scale):
    q = qkv[0, :H * E].reshape(H, E).astype(np.float64)
    k = np.repeat(kc[0, :, :n].astype(np.float64), H // Hk, axis=0)       # (H, n, E)
    v = np.repeat(vc[0, :, :n].astype(np.float64), H // Hk, axis=0)
    s = np.einsum("he,hne->hn", q, k) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hn,hne->he", p, v).reshape(1, H * E)


@pytest.mark.parametrize(("H", "Hk", "E", "n", "cap"), [(9, 3, 64, 1, 1), (9, 3, 64, 17, 40), (4, 4, 32, 300, 300),
                                                        (8, 2, 16, 4100, 4200)])
def test_the_attention_equals_float64_numpy(H, Hk, E, n, cap):
    rng = np.random.default_rng(n)
    qkv = rng.normal(0, 2, (1, (H + 2 * Hk) * E)).astype(np.float32)
    kc = rng.normal(0, 1, (1, Hk, cap, E)).astype(np.float32)
    vc = rng.normal(0, 1, (1, Hk, cap, E)).astype(np.float32)
    kc[:, :, n:] = 1e30                                                # beyond n: never read
    out = np.empty((1, H * E), np.float32)
    _attend(qkv, kc, vc, n, H, Hk, E, E ** -0.5, out)
    want = _reference(qkv, kc, vc, n, H, Hk, E, E ** -0.5)
    # float32 scores, weights and sums over n keys: |Δ| within a few float32 units of the values' scale
    assert np.abs(out - want).max() <= 2e-6 * np.sqrt(n) * np.abs(vc[0, :, :n]).max()


def test_the_attention_follows_the_key_value_head_of_each_query_head():
    H, Hk, E, n = 6, 2, 8, 5
    qkv = np.zeros((1, (H + 2 * Hk) * E), np.float32)
    kc = np.zeros((1, Hk, n, E), np.float32)
    vc = np.stack([np.full((n, E), g + 1.0, np.float32) for g in range(Hk)])[None]
    out = np.empty((1, H * E), np.float32)
    _attend(qkv, kc, vc, n, H, Hk, E, 1.0, out)
    assert out.reshape(H, E)[:, 0].tolist() == [1, 1, 1, 2, 2, 2]    # heads 0–2 read V of head 0, 3–5 of 1
