"""The tests of tests/unit/test_explain.py that need torch or transformers."""

import numpy as np
import pytest

from qkv.explain import examples as ex


def _torch_mha(w, heads):
    """torch's MultiheadAttention with the worked example's W_Q, W_K, W_V, W_O (no biases), float64, and its X."""
    torch = pytest.importorskip("torch")
    D = w.X.shape[1]
    m = torch.nn.MultiheadAttention(D, heads, bias=False, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.from_numpy(np.concatenate([w.W_Q.T, w.W_K.T, w.W_V.T])))
        m.out_proj.weight.copy_(torch.from_numpy(w.W_O.T))
    return m, torch.from_numpy(w.X)[None]


def test_two_head_example_equals_torch():
    w = ex.load_example("two_head")
    m, x = _torch_mha(w, 2)
    t = ex.run(w)
    out, wts = m(x, x, x, need_weights=True, average_attn_weights=False)
    np.testing.assert_allclose(t["final_output"].array, out.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(t["weights"].array, wts.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert t.names()[-2:] == ["concat", "final_output"]


def test_one_head_with_w_o_ends_with_the_output_projection_as_torch():
    # W_O is the module's output projection whatever the number of heads: one head's output is its concat
    w = ex.load_example("two_head")
    m, x = _torch_mha(w, 1)
    want = m(x, x, x)[0].detach().numpy()[0]
    t = ex.run(w, heads=1)
    assert t.names()[-2:] == ["output", "final_output"]
    np.testing.assert_allclose(t["final_output"].array, want, rtol=1e-12, atol=1e-14)
    rows = ex.run_rows(w, [0, 2], heads=1, block_cells=2)                 # the large-input path, in blocks
    np.testing.assert_allclose(rows["final_output"].array, want, rtol=1e-12, atol=1e-14)
