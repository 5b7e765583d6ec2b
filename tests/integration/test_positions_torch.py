"""The tests of tests/unit/test_positions.py that need torch or transformers."""

import numpy as np
import pytest

import qkv


def test_seed000_path_matches_torch():
    """ids → embeddings + positions → MultiheadAttention(512, 8) → W_O, as torch computes it."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    t_emb = torch.nn.Embedding(1000, 512)
    t_mha = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
    ids = [[101, 234, 567]]
    emb = qkv.TokenEmbedding(1000, 512, weight=t_emb.weight.detach().numpy())
    mha = qkv.MultiHeadAttention.from_torch(t_mha)
    x = emb(ids)                                                       # (1, 3, 512)
    with torch.no_grad():
        tx = t_emb(torch.tensor(ids)) + torch.from_numpy(qkv.sinusoidal_positions(3, 512))
        want, want_w = t_mha(tx, tx, tx, average_attn_weights=False)
    np.testing.assert_allclose(x, tx.numpy(), atol=1e-6)
    out, w = mha(x, need_weights=True, average_attn_weights=False)
    np.testing.assert_allclose(out, want.numpy(), atol=1e-5)
    np.testing.assert_allclose(w, want_w.numpy(), atol=1e-6)
