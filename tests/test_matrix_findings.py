"""Bugs the differential matrix (tests/test_matrix.py) found, each held here by a small test of its own."""
import numpy as np
import pytest

import qkv
from qkv import mods
from qkv.backends import get


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_causal_alibi_softcap_keeps_the_diagonal_blocks_masked(kernels, dtype):
    """``is_causal`` with ``compose(alibi, softcap)`` on the tiled backend: a diagonal block took ALiBi's bias as
    a cached pattern carrying the causal −inf, and the cap after it turned −inf into −cap, so every query saw
    the keys after it (2.1 off the reference). Found by the matrix (L = 40, S = 29, float16)."""
    if kernels == "numba":
        pytest.importorskip("numba")
    r = np.random.default_rng(0)
    q, k, v, go = (r.standard_normal((1, 2, 16, 8)).astype(dtype) for _ in range(4))
    sm = mods.compose(mods.alibi(mods.alibi_slopes(2)), mods.softcap(1.0))
    kw = dict(scale=0.35, is_causal=True, score_mod=sm)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    want = get("reference").forward(*wide, **kw)[0]
    want_grads = get("reference").backward(go.astype(np.float64), *wide, **kw)
    before = qkv.kernels.get_kernels()
    qkv.kernels.set_kernels(kernels)
    try:
        with qkv.backends.tiled.limits(kernel_min=0):
            got = get("tiled").forward(q, k, v, block_q=8, block_k=8, **kw)[0]
            grads = get("tiled").backward(go, q, k, v, block_q=8, block_k=8, **kw)
    finally:
        qkv.kernels.set_kernels(before)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert np.abs(got - want).max() <= tol
    for g, w in zip(grads, want_grads):
        assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max())


def test_float16_sink_logits_raise_no_warning():
    """float16 sink logits were compared with 1e30 in float16 (inf): a RuntimeWarning on every call."""
    import warnings
    q = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = qkv.flex_attention(q, q, q, sink_logits=np.zeros(2, np.float16))
    assert out.dtype == np.float16 and np.isfinite(out).all()
    with pytest.raises(ValueError, match="sink_logits: expected logits within"):
        qkv.flex_attention(q, q, q, sink_logits=np.array([0.0, 1e31]))
