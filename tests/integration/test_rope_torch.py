"""The tests of tests/unit/test_rope.py that need torch or transformers."""

import numpy as np
import pytest

import qkv
from qkv.positions import rope

torch = pytest.importorskip("torch")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig


def hf_config(hidden=32, heads=4, kv_heads=2, theta=10000.0):
    return LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       rope_theta=theta, max_position_embeddings=4096, attention_bias=False,
                       attn_implementation="eager", intermediate_size=64, num_hidden_layers=1, vocab_size=16)


def hf_cos_sin64(position_ids, E, theta):
    """cos, sin (B, T, E) exactly as LlamaRotaryEmbedding.forward computes them, but in float64."""
    inv = 1.0 / (theta ** (torch.arange(0, E, 2, dtype=torch.float64) / E))
    freqs = position_ids[..., None].double() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# ------------------------------------------------------------------------------------- against Hugging Face
@pytest.mark.parametrize("theta", [10000.0, 500000.0, 100.0])
@pytest.mark.parametrize("E", [2, 16, 64])
def test_neox_equals_hf_apply_rotary_pos_emb_float32(theta, E, rng):
    """With LlamaRotaryEmbedding's own float32 cos/sin, at positions where its float32 angles are exact enough."""
    B, H, T = 2, 3, 11
    cfg = hf_config(hidden=E * 4, heads=4, kv_heads=4, theta=theta)
    emb = llama.LlamaRotaryEmbedding(cfg)
    q = rng.standard_normal((B, H, T, E)).astype(np.float32)
    k = rng.standard_normal((B, H, T, E)).astype(np.float32)
    pos = rng.integers(0, 64, (B, T))                                       # custom, per batch row
    cos, sin = emb(torch.from_numpy(q), torch.from_numpy(pos))
    q_ref, k_ref = llama.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    q_rot, k_rot = rope(q, pos, theta=theta), rope(k, pos, theta=theta, name="K_rot")
    assert q_rot.dtype == np.float32 and q_rot.shape == q.shape
    np.testing.assert_allclose(q_rot, q_ref.numpy(), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(k_rot, k_ref.numpy(), atol=2e-5, rtol=2e-5)
    # default positions 0 … T−1 = position_ids arange(T)
    cos, sin = emb(torch.from_numpy(q), torch.arange(T)[None])
    q_ref, _ = llama.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    np.testing.assert_allclose(rope(q, theta=theta), q_ref.numpy(), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(qkv.RoPE(theta)(q, np.arange(T)), q_ref.numpy(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("theta", [10000.0, 500000.0, 2.5])
def test_neox_equals_hf_float64_large_positions(theta, rng):
    """HF's formula with float64 cos/sin: equal to 1e-10 up to position 10⁵ (HF's float32 angles would not be)."""
    B, H, T, E = 2, 4, 9, 32
    q = rng.standard_normal((B, H, T, E))
    pos = rng.integers(0, 100_000, (B, T))
    cos, sin = hf_cos_sin64(torch.from_numpy(pos), E, theta)
    q_ref, _ = llama.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    out = rope(q, pos, theta=theta)
    assert out.dtype == np.float64
    # angles up to 1e5 rad carry float64 rounding of ~1e5 × 2e-16; cos/sin of them agree to ~1e-11
    np.testing.assert_allclose(out, q_ref.numpy(), atol=1e-10, rtol=1e-10)
    # float32 input: angles in float64, so the error is float32 rounding only (HF's float32 angles at
    # position ~1e5 are off by ~1e5 × 6e-8 rad)
    out32 = rope(q.astype(np.float32), pos, theta=theta)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, q_ref.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl,dtype,tol", [
    ("eager", np.float32, 2e-5),
    ("eager", np.float64, 1e-6),     # HF's eager attention takes the softmax in float32 even for float64
    ("sdpa", np.float64, 1e-10),     # torch's SDPA (is_causal) in float64 throughout
])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_mha_equals_hf_llama_attention(impl, dtype, tol, heads, kv_heads, theta, rng):
    """Hugging Face LlamaAttention (no biases, scaling 1/√head_dim, causal) with the same weights, GQA/MQA/MHA."""
    D, B, L = 64, 2, 7
    cfg = hf_config(hidden=D, heads=heads, kv_heads=kv_heads, theta=theta)
    cfg._attn_implementation = impl
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    torch.manual_seed(0)
    ref = llama.LlamaAttention(cfg, layer_idx=0).to(tdt).eval()
    emb = llama.LlamaRotaryEmbedding(cfg)
    m = qkv.MultiHeadAttention(D, heads, num_kv_heads=kv_heads, bias=False, dtype=dtype, rope=qkv.RoPE(theta))
    m.load(W_Q=ref.q_proj.weight.detach().numpy().T, W_K=ref.k_proj.weight.detach().numpy().T,
           W_V=ref.v_proj.weight.detach().numpy().T, W_O=ref.o_proj.weight.detach().numpy().T)
    x = rng.standard_normal((B, L, D)).astype(dtype)
    causal = torch.full((L, L), float("-inf"), dtype=tdt).triu(1)[None, None]     # (1, 1, L, L) additive
    if impl == "sdpa":
        causal = None                                                               # HF then passes is_causal
    for pos in (np.broadcast_to(np.arange(L), (B, L)), rng.integers(0, 60, (B, L))):
        xt, pt = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(pos))
        if dtype == np.float64:
            cos, sin = hf_cos_sin64(pt, D // heads, theta)     # HF's formula in float64 (its module uses float32)
        else:
            cos, sin = emb(xt, pt)
        with torch.no_grad():
            want, _ = ref(xt, position_embeddings=(cos, sin), attention_mask=causal)
        got, _ = m(x, is_causal=True, positions=pos)
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want.numpy(), atol=tol, rtol=tol)
