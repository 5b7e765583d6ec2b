"""The tests of tests/unit/test_explain_variants.py that need torch or transformers."""
import math
import warnings

import numpy as np
import pytest

from qkv.explain import examples as ex
from test_explain_variants import as2d  # noqa: E402,F401  (its helpers, shared)


def test_rope_equals_transformers_apply_rotary_pos_emb():
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    w = ex.load_example("rope")
    t = ex.run(w)
    E = w.Q.shape[1]
    inv = 1.0 / (w.rope["theta"] ** (torch.arange(0, E, 2, dtype=torch.float64) / E))
    freqs = torch.arange(3, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)                                     # (T, E), HF's layout
    q, k = (torch.from_numpy(a)[None, None] for a in (w.Q, w.K))                # (1, 1, T, E)
    qr, kr = llama.apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    np.testing.assert_allclose(t["Q_rot"].array, qr[0, 0].numpy(), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(t["K_rot"].array, kr[0, 0].numpy(), rtol=1e-14, atol=1e-15)


# ----------------------------------------------------------------------------------------------- ALiBi, softcap
def _torch_flex(w, score_mod=None, mask_mod=None):
    torch = pytest.importorskip("torch")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    L, S = w.n_queries, w.n_keys
    if w.start == "scores":                                     # scores as q·kᵀ with q = scores, k = I (d = S)
        q, k, scale = w.scores, np.eye(S), 1 / math.sqrt(float(w.d_k))
    else:
        q, k, scale = w.Q, w.K, 1 / math.sqrt(float(w.d_k or w.Q.shape[1]))
    v = w.V
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))[None, None] for a in (q, k, v))
    if tk.shape[-1] != tq.shape[-1]:
        raise AssertionError("widths")
    bm = None if mask_mod is None else fa.create_block_mask(mask_mod, None, None, L, S, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fa.flex_attention(tq, tk, tv, score_mod=score_mod, block_mask=bm, scale=scale)
    return out[0, 0].numpy()


def test_alibi_by_hand_and_against_torch_flex_attention():
    w = ex.load_example("alibi")
    t = ex.run(w)
    # scaled = scores / √4: row 吃 = [0.7, 0.2, 1.2] / 2 = [0.35, 0.1, 0.6]
    # biased[吃, j] = scaled + 0.5·(j − 2): 0.35 + 0.5×(−2) = −0.65, 0.1 + 0.5×(−1) = −0.4, 0.6 + 0 = 0.6
    np.testing.assert_allclose(t["biased"].array[2], [-0.65, -0.4, 0.6], atol=1e-15)
    # softmax: exp(−0.65 − 0.6) = exp(−1.25) = 0.286505, exp(−1.0) = 0.367879, exp(0) = 1; sum 1.654384
    np.testing.assert_allclose(t["weights"].array[2], [0.173179, 0.222364, 0.604457], atol=5e-6)
    np.testing.assert_allclose(t["weights"].array[2].sum(), 1.0)
    assert t["masked"].array[0, 1] == -np.inf                 # causal, and a bias is not a mask

    def alibi(score, b, h, qi, ki):
        return score + 0.5 * (ki - qi)

    def causal(b, h, qi, ki):
        return qi >= ki
    np.testing.assert_allclose(t["output"].array, _torch_flex(w, alibi, causal), rtol=1e-12, atol=1e-14)


def test_softcap_by_hand_and_against_torch_flex_attention():
    w = ex.load_example("softcap")
    t = ex.run(w)
    # scaled = scores / 2: 我 [3, 1, 0], 吃 [−1, 0, 5]; capped = 2·tanh(s / 2)
    # 2·tanh(1.5) = 2×0.905148 = 1.810296; 2·tanh(0.5) = 2×0.462117 = 0.924234; 2·tanh(0) = 0
    np.testing.assert_allclose(t["capped"].array[0], [1.810296, 0.924234, 0.0], atol=5e-7)
    # 2·tanh(−0.5) = −0.924234; 0; 2·tanh(2.5) = 2×0.986614 = 1.973229
    np.testing.assert_allclose(t["capped"].array[2], [-0.924234, 0.0, 1.973229], atol=5e-7)
    assert np.all(np.abs(t["capped"].array) < 2)

    def softcap(score, b, h, qi, ki):
        import torch
        return 2 * torch.tanh(score / 2)
    np.testing.assert_allclose(t["output"].array, _torch_flex(w, softcap), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------- masks
def test_sliding_window_by_hand_and_against_torch_flex_attention():
    w = ex.load_example("sliding_window")
    t = ex.run(w)
    allowed = np.isfinite(t["masked"].array)
    # window 2: query i sees keys i − 1 … i
    np.testing.assert_array_equal(allowed, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
    # 吃: q = [1, 1]; keys 爱 [0, 1], 吃 [1, 1]: scores 1, 2; scaled 1/√2 = 0.707107, 2/√2 = 1.414214
    # weights: exp(0.707107 − 1.414214) = 0.493069 and 1 → 0.493069 / 1.493069 = 0.330238, 0.669762
    np.testing.assert_allclose(t["weights"].array[2], [0, 0.330238, 0.669762, 0], atol=5e-7)

    def window(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < 2)
    np.testing.assert_allclose(t["output"].array, _torch_flex(w, None, window), rtol=1e-12, atol=1e-14)


def test_document_by_hand_and_against_torch_flex_attention():
    w = ex.load_example("document")
    np.testing.assert_array_equal(w.documents, [0, 0, 1, 1, 1])                # lengths [2, 3]
    t = ex.run(w)
    allowed = np.isfinite(t["masked"].array)
    np.testing.assert_array_equal(allowed, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                            [0, 0, 1, 1, 1]])
    # 吃 (document 1): q = [0, 1] against 我 [1, 1], 爱 [1, 0], 吃 [0, 1]: scores 1, 0, 1, scaled 0.707107, 0,
    # 0.707107; exps 1, 0.493069, 1, sum 2.493069 → 0.401112, 0.197776, 0.401112
    np.testing.assert_allclose(t["weights"].array[4], [0, 0, 0.401112, 0.197776, 0.401112], atol=5e-7)
    # output[吃] = 0.401112·[1, 1] + 0.197776·[2, 0] + 0.401112·[0, 2] = [0.796664, 1.203336]
    np.testing.assert_allclose(t["output"].array[4], [0.796664, 1.203336], atol=2e-6)
    ids = np.array([0, 0, 1, 1, 1])

    def doc_causal(b, h, qi, ki):
        import torch
        d = torch.from_numpy(ids)
        return (qi >= ki) & (d[qi] == d[ki])
    np.testing.assert_allclose(t["output"].array, _torch_flex(w, None, doc_causal), rtol=1e-12, atol=1e-14)


def test_sinks_by_hand_and_against_a_dense_torch_formula():
    torch = pytest.importorskip("torch")
    w = ex.load_example("sinks")
    t = ex.run(w)
    allowed = np.isfinite(as2d(t["masked"].array))
    # key 0 always visible (sinks: 1) or the window of 2
    np.testing.assert_array_equal(allowed, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]])
    # 苹果: scores [2, 0, 1, 1] (d_k = 1), key 1 masked; sink logit 0 joins: max 2;
    # exps 1, 0, e^−1 = 0.367879, 0.367879, sink e^−2 = 0.135335; sum 1.871094
    # weights 1/1.871094 = 0.534447, 0, 0.196612, 0.196612 — summing to 0.927671 < 1
    wts = as2d(t["weights"].array)
    np.testing.assert_allclose(wts[3], [0.534447, 0, 0.196612, 0.196612], atol=5e-7)
    np.testing.assert_allclose(wts[3].sum(), 1 - math.exp(-2) / (1 + 2 * math.exp(-1) + math.exp(-2)))
    np.testing.assert_allclose(wts[0, 0], 0.5)                # 我: exp(0) / (exp(0) + exp(0))
    # torch: a sink column appended to the logits, softmax, the column dropped
    logits = torch.from_numpy(np.where(allowed, w.scores, -np.inf))
    full = torch.softmax(torch.cat([logits, torch.zeros(4, 1, dtype=torch.float64)], dim=-1), dim=-1)[:, :4]
    np.testing.assert_allclose(wts, full.numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(as2d(t["output"].array), (full @ torch.from_numpy(w.V)).numpy(), rtol=1e-13)
