"""The tests of tests/unit/test_dispatch.py that need torch or transformers."""

import numpy as np
import pytest

import qkv
from qkv.backends import tiled
from test_dispatch import _qkv  # noqa: E402,F401  (its helpers, shared)

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("backend", ["reference", "tiled", "torch"])
def test_return_lse_from_every_backend(backend, rng):
    q, k, v = _qkv(rng, (2, 13, 8), np.float64)
    mask = rng.random((13, 13)) < 0.5
    mask[4] = False
    out, w, lse = qkv.scaled_dot_product_attention(q, k, v, mask, backend=backend, return_weights=True,
                                                   return_lse=True)
    out2, lse2 = qkv.scaled_dot_product_attention(q, k, v, mask, backend=backend, return_lse=True)
    np.testing.assert_allclose(out2, out, atol=1e-12)
    s = np.where(mask, q @ k.transpose(0, 2, 1) / np.sqrt(8), -np.inf)
    want = torch.logsumexp(torch.from_numpy(s), -1).numpy()
    np.testing.assert_allclose(lse, want, atol=1e-12)
    np.testing.assert_allclose(lse2, want, atol=1e-12)
    assert np.all(lse[:, 4] == -np.inf) and np.all(out[:, 4] == 0) and np.all(w[:, 4] == 0)


def test_torch_tensors_in_torch_tensors_out(rng):
    q, k, v = _qkv(rng, (2, 4, 9, 8))
    mask = rng.random((9, 9)) < 0.5
    mask[3] = False                                              # a row with nothing to attend to
    tq, tk, tv, tm = map(torch.from_numpy, (q, k, v, mask))
    out = qkv.scaled_dot_product_attention(tq, tk, tv, tm)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    want = qkv.scaled_dot_product_attention(q, k, v, mask, backend="reference")
    np.testing.assert_allclose(out.numpy(), want, atol=2e-6)
    assert torch.all(out[..., 3, :] == 0)                        # qkv semantics, not NaN
    out, w, lse = qkv.scaled_dot_product_attention(tq, tk, tv, is_causal=True, return_weights=True,
                                                   return_lse=True)
    ref_out, ref_w, ref_lse = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True,
                                                               return_lse=True, backend="reference")
    for a, b in ((out, ref_out), (w, ref_w), (lse, ref_lse)):
        assert isinstance(a, torch.Tensor)
        np.testing.assert_allclose(a.numpy(), b, atol=2e-6)
    # grouped-query and float masks on torch too
    kq = tk[:, :2]
    out = qkv.scaled_dot_product_attention(tq, kq, tv[:, :2], enable_gqa=True,
                                           attn_mask=torch.from_numpy(np.where(mask, 0.0, -np.inf)).float())
    want = qkv.scaled_dot_product_attention(q, k[:, :2], v[:, :2], np.where(mask, 0.0, -np.inf).astype(np.float32),
                                            enable_gqa=True, backend="reference")
    np.testing.assert_allclose(out.numpy(), want, atol=2e-6)


def test_torch_tensor_bad_input():
    t = torch.zeros(2, 3, 4)
    with pytest.raises(TypeError, match="key"):
        qkv.scaled_dot_product_attention(t, np.zeros((2, 3, 4), np.float32), t)
    with pytest.raises(ValueError, match="key"):
        qkv.scaled_dot_product_attention(t, torch.zeros(2, 3, 5), t)
    with pytest.raises(TypeError, match="dtype"):
        qkv.scaled_dot_product_attention(t, t.double(), t)
    with pytest.raises(ValueError, match="backend"):
        qkv.scaled_dot_product_attention(t, t, t, backend="tiled")
    with pytest.raises(ValueError, match="rng"):
        qkv.scaled_dot_product_attention(t, t, t, dropout_p=0.5, rng=np.random.default_rng(0))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_path_keeps_dtype_and_autograd(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g).to(dt).requires_grad_()
    mask = torch.ones(9, 9, dtype=torch.bool)
    mask[3] = False                                              # a row with nothing to attend to
    out = qkv.scaled_dot_product_attention(q, q, q, mask)
    assert out.dtype == dt and torch.all(out[..., 3, :] == 0)
    out.float().square().sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())
    if dtype == "float32":                                       # the gradient equals qkv's own backward
        qn = q.detach().numpy()
        go = 2 * out.detach().numpy()
        dq, dk, dv = qkv.scaled_dot_product_attention_backward(go, qn, qn, qn, attn_mask=mask.numpy())
        np.testing.assert_allclose(q.grad.numpy(), dq + dk + dv, atol=1e-4)


def test_auto_and_every_backend_agree(rng, monkeypatch):
    q, k, v = _qkv(rng, (1, 8, 512, 16))
    calls = []
    real = tiled.tiled_attention
    monkeypatch.setitem(qkv.backends.BACKENDS, "tiled", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    auto = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls == [1]                                          # large: auto took the tiled engine
    for name in ("reference", "tiled", "torch"):
        got = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend=name)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_allclose(got, auto, atol=2e-5, rtol=2e-5)


def test_threads_argument_per_call(rng, monkeypatch):
    q, k, v = _qkv(rng, (1, 4, 400, 16))
    seen = []
    real = tiled.forward
    monkeypatch.setattr(tiled.backend, "forward", lambda *a, **kw: seen.append(kw.get("threads")) or real(*a, **kw))
    want = qkv.scaled_dot_product_attention(q, k, v, backend="reference")
    for n in (1, 3):
        got = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", threads=n)
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert seen == [1, 3]
    for name in ("reference", "torch"):                          # accepted and ignored
        qkv.scaled_dot_product_attention(q, k, v, backend=name, threads=2)
    for bad, err in ((0, ValueError), (1.5, TypeError), ("2", TypeError)):
        with pytest.raises(err, match="threads"):
            qkv.scaled_dot_product_attention(q, k, v, threads=bad)
