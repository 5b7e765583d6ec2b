"""The tests of tests/unit/test_gemm.py that need a model package (MiniLM, SmolLM2) or its readers."""

import numpy as np
import pytest

from qkv import gemm, kernels
from test_gemm import HAS_MKL, _Calls, _both, _counting_loop  # noqa: E402,F401  (its helpers, shared)


@pytest.fixture
def restore_gemm():
    saved = gemm.GEMM.choice
    yield
    gemm.set_gemm(saved)


@pytest.fixture
def mkl():
    if not HAS_MKL:
        pytest.skip("the mkl extra is not installed: pip install 'qkv[mkl]'")
    return gemm.GEMM.provider("mkl")


# ---------------------------------------------------------------------------------------------- every path
@pytest.fixture
def counted_mkl(mkl, monkeypatch, restore_gemm):
    """MKL chosen, its matmul counted (so a path that bypasses the provider fails, not passes vacuously);
    its exp calls counted in ``calls.exps``."""
    calls = _Calls()
    real, real_exp = mkl.matmul, mkl.exp

    def counting(a, b, out=None):
        calls.append((np.shape(a), np.shape(b)))
        return real(a, b, out=out)

    def counting_exp(x, out=None):
        calls.exps.append(np.shape(x))
        return real_exp(x, out=out)
    monkeypatch.setattr(mkl, "matmul", counting)
    monkeypatch.setattr(mkl, "exp", counting_exp)
    for name in ("run_plain", "run_plain_lazy", "run_plain_backward"):   # the compiled loops call the provider's
        monkeypatch.setattr(kernels, name, _counting_loop(calls, mkl, getattr(kernels, name)))   # C sgemm
    return calls


def test_minilm_encode_through_mkl_equals_numpy(counted_mkl):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    from qkv.models import load_bert
    try:
        model = load_bert()
    except (FileNotFoundError, ImportError, ValueError) as e:
        pytest.skip(f"all-MiniLM-L6-v2 is not installed: {e}")
    texts = ["The cat sat on the mat.", "Attention is all you need, they said, and then wrote a long paper.",
             "Short."] * 5
    ref, got = _both(lambda: model.encode(texts, batch_size=4, progress=False))
    assert len(counted_mkl) >= 6 * 4                              # Q, K, V, O projections and the FFN, per layer
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)
