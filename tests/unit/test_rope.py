"""Rotary position embedding: qkv.positions.rope, qkv.RoPE, MultiHeadAttention(rope=) and cached decoding.

References: Hugging Face Llama's ``apply_rotary_pos_emb`` / ``LlamaRotaryEmbedding`` / ``LlamaAttention`` (neox
style) and the complex-number form of Meta's ``apply_rotary_emb`` written here with NumPy (interleaved style).
Shape legend: B batch, H query heads, Hk key/value heads, L query length, S key length, T length, E head width.
"""
import math

import numpy as np
import pytest

import qkv
from qkv.positions import rope


def complex_rope(x, pos, theta):
    """Meta's apply_rotary_emb: x viewed as complex pairs (2i, 2i+1), times exp(i·pos·θ_i)."""
    E = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, E, 2) / E)
    xc = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2].astype(np.float64)
    rot = xc * np.exp(1j * np.asarray(pos, np.float64)[..., None] * inv)
    out = np.empty(x.shape, np.float64)
    out[..., 0::2], out[..., 1::2] = rot.real, rot.imag
    return out


def test_positions_shapes_broadcast_batch_first(rng):
    """(T,), (B, T) (HF's position_ids), (B, 1, T), (B, H, T) for x (B, H, T, E); leading dims match from the left."""
    B, H, T, E = 3, 2, 5, 8
    x = rng.standard_normal((B, H, T, E))
    pos = rng.integers(0, 50, (B, T))
    per_row = np.stack([np.stack([rope(x[b, h], pos[b]) for h in range(H)]) for b in range(B)])
    np.testing.assert_allclose(rope(x, pos), per_row, atol=1e-14)
    np.testing.assert_allclose(rope(x, pos[:, None, :]), per_row, atol=1e-14)
    np.testing.assert_allclose(rope(x, np.broadcast_to(pos[:, None, :], (B, H, T))), per_row, atol=1e-14)
    np.testing.assert_allclose(rope(x, pos[:1]), rope(x, np.broadcast_to(pos[:1], (B, T))), atol=1e-14)
    np.testing.assert_allclose(rope(x, list(range(T))), rope(x), atol=0)
    assert rope(x[0, 0], np.arange(T, dtype=np.int32)).shape == (T, E)
    assert rope(x.astype(np.float16)).dtype == np.float16


@pytest.mark.parametrize("theta", [10000.0, 500000.0, 3.0])
def test_interleaved_equals_complex_form(theta, rng):
    B, H, T, E = 2, 3, 7, 16
    x = rng.standard_normal((B, H, T, E))
    pos = rng.integers(0, 5000, (B, T))
    ref = complex_rope(x, pos[:, None, :], theta)
    np.testing.assert_allclose(rope(x, pos, theta=theta, style="interleaved"), ref, atol=1e-11, rtol=1e-11)
    out32 = qkv.RoPE(theta, "interleaved")(x.astype(np.float32), pos)
    np.testing.assert_allclose(out32, ref, atol=1e-5, rtol=1e-5)
    # the two styles are the same rotation up to a permutation of the coordinates
    perm = np.concatenate([np.arange(0, E, 2), np.arange(1, E, 2)])         # interleaved → halves
    np.testing.assert_allclose(rope(x[..., perm], pos, theta=theta)[..., np.argsort(perm)],
                               rope(x, pos, theta=theta, style="interleaved"), atol=1e-12)


# ------------------------------------------------------------------------------------- hand-checked values
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("theta", [10000.0, 2.0, 1e9])
def test_hand_checked_E2(style, theta):
    """E = 2: θ_0 = theta⁰ = 1, so position 1 rotates (1, 0) by 1 radian to (cos 1, sin 1) whatever theta."""
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    out = rope(x, np.array([0, 1, 1]), theta=theta, style=style)
    np.testing.assert_allclose(out[0], [1.0, 0.0], atol=1e-15)                       # position 0: unchanged
    np.testing.assert_allclose(out[1], [math.cos(1), math.sin(1)], atol=1e-15)       # (0.5403, 0.8415)
    np.testing.assert_allclose(out[2], [-math.sin(1), math.cos(1)], atol=1e-15)
    assert out[1, 0] == pytest.approx(0.540302, abs=1e-6) and out[1, 1] == pytest.approx(0.841471, abs=1e-6)


def test_cos_sin_and_angles():
    r = qkv.RoPE(100.0)
    cos, sin = r.cos_sin(np.arange(3), 4, np.float32)
    assert cos.shape == sin.shape == (3, 2) and cos.dtype == np.float32
    # θ = (1, 100^(−1/2)) = (1, 0.1): position 2 → angles (2, 0.2)
    np.testing.assert_allclose(cos[2], np.cos([2.0, 0.2]), rtol=1e-6)
    np.testing.assert_allclose(qkv.positions.inv_freq(4, 100.0), [1.0, 0.1], rtol=1e-15)
    # the rotation preserves norms
    x = np.random.default_rng(0).standard_normal((6, 10))
    np.testing.assert_allclose(np.linalg.norm(rope(x, np.arange(6) * 37), axis=-1), np.linalg.norm(x, axis=-1))


def _direct_cos_sin(p, E, theta):
    """cos, sin of position × θ_i computed anew (float64), what the tables must equal bit for bit."""
    angles = np.asarray(p).astype(np.float64)[..., None] * qkv.positions.inv_freq(E, theta)
    return np.cos(angles), np.sin(angles)


def test_cos_sin_comes_from_a_kept_table_equal_to_computing_it_again(monkeypatch):
    from qkv import positions

    tables = positions._AngleTables()
    monkeypatch.setattr(positions, "ANGLE_TABLES", tables)
    E, theta = 64, 100000.0

    def check(p, dtype=np.float64):
        cos, sin = qkv.RoPE(theta).cos_sin(p, E, dtype)
        c, s = _direct_cos_sin(p, E, theta)
        assert cos.shape == sin.shape == np.shape(p) + (E // 2,) and cos.dtype == dtype
        np.testing.assert_array_equal(cos, c.astype(dtype))
        np.testing.assert_array_equal(sin, s.astype(dtype))

    check(np.arange(10))
    assert (tables.builds, tables.hits) == (1, 0)
    check(np.array([[3, 7, 1023], [0, 1, 2]]), np.float32)             # within the table: looked up
    assert (tables.builds, tables.hits) == (1, 1)
    check(np.array([5000, 4999, 2]))                                    # beyond it: the table grows (8192)
    assert tables.builds == 2 and tables._tables[(E, theta)][0].shape == (8192, E // 2)
    check(np.arange(0, 8192, 7))                                        # old and new positions, one table
    check(np.array([0]))
    assert (tables.builds, tables.hits) == (2, 3)
    check(np.arange(5), np.float32)
    rope_x = np.random.default_rng(0).standard_normal((2, 3, 5, E)).astype(np.float32)
    pos = np.array([[4, 9, 100, 2, 8191], [0, 1, 2, 3, 4]])            # (B, T): Hugging Face's position_ids
    c, s = _direct_cos_sin(pos[:, None, :], E, theta)
    np.testing.assert_array_equal(qkv.RoPE(theta)(rope_x, pos),
                                  qkv.stages.rope(rope_x, c, s, style="neox"))   # rope() uses the table too
    assert tables.builds == 2 and tables.hits == 5


def test_cos_sin_tables_per_width_and_theta_bounded(monkeypatch):
    from qkv import positions

    tables = positions._AngleTables()
    monkeypatch.setattr(positions, "ANGLE_TABLES", tables)
    monkeypatch.setattr(tables, "MAX_TABLES", 2)
    for E, theta in ((64, 10000.0), (32, 10000.0), (64, 500000.0)):   # the third drops the least recent
        cos, _ = positions.cos_sin(np.arange(20), E, theta=theta)
        np.testing.assert_array_equal(cos, _direct_cos_sin(np.arange(20), E, theta)[0])
    assert list(tables._tables) == [(32, 10000.0), (64, 500000.0)] and tables.builds == 3
    far = np.array([10**7, 3])                                          # a table this long is not kept
    cos, sin = positions.cos_sin(far, 64, theta=10000.0)
    np.testing.assert_array_equal(sin, _direct_cos_sin(far, 64, 10000.0)[1])
    assert tables.builds == 3 and (64, 10000.0) not in tables._tables
    cos, sin = positions.cos_sin(np.zeros((0,), np.int64), 64)         # no positions: no table
    assert cos.shape == (0, 32) and tables.builds == 3


# ------------------------------------------------------------------------------------- relative positions
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_dot_product_depends_only_on_offset(style, rng):
    q, k = rng.standard_normal((1, 32)), rng.standard_normal((1, 32))

    def dot(m, n):
        return (rope(q, [m], style=style) @ rope(k, [n], style=style).T).item()

    for d in (0, 1, 5, -3, 40):
        vals = [dot(m, m - d) for m in (40, 41, 100, 1000, 12345) if m - d >= 0]
        np.testing.assert_allclose(vals, vals[0], rtol=1e-10, atol=1e-10)
    assert abs(dot(10, 3) - dot(10, 4)) > 1e-6                     # it does depend on the offset
    assert dot(0, 0) == pytest.approx((q @ k.T).item())


# ------------------------------------------------------------------------------------- MultiHeadAttention
def manual_mha(m, x, pos, causal):
    """project, split, rope, SDPA, merge, W_O, by hand."""
    B, L, _ = x.shape
    H, Hk, E = m.num_heads, m.num_kv_heads, m.head_dim
    q = (x @ m.W_Q + (m.b_Q if m.bias else 0)).reshape(B, L, H, E).transpose(0, 2, 1, 3)
    k = (x @ m.W_K + (m.b_K if m.bias else 0)).reshape(B, L, Hk, E).transpose(0, 2, 1, 3)
    v = (x @ m.W_V + (m.b_V if m.bias else 0)).reshape(B, L, Hk, E).transpose(0, 2, 1, 3)
    p = np.broadcast_to(pos, (B, L))[:, None, :, None]                       # (B, 1, L, 1)
    inv = m.rope.theta ** (-np.arange(0, E, 2) / E)
    ang = p * inv                                                            # (B, 1, L, E/2)
    if m.rope.style == "neox":
        a, b = q[..., :E // 2], q[..., E // 2:]
        q = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)
        a, b = k[..., :E // 2], k[..., E // 2:]
        k = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)
    else:
        q = complex_rope(q, p[..., 0], m.rope.theta)
        k = complex_rope(k, p[..., 0], m.rope.theta)
    k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(E)
    if causal:
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = (w @ v).transpose(0, 2, 1, 3).reshape(B, L, H * E)
    return o @ m.W_O + (m.b_O if m.bias else 0)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_mha_with_rope_equals_manual(style, num_kv_heads, rng):
    m = qkv.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, dtype=np.float64, seed=1,
                               rope=qkv.RoPE(1000.0, style))
    m.load(b_Q=rng.standard_normal(32), b_K=rng.standard_normal(m.b_K.shape), b_V=rng.standard_normal(m.b_V.shape))
    x = rng.standard_normal((2, 6, 32))
    for pos, causal in [(None, False), (np.arange(6), True), (rng.integers(0, 900, (2, 6)), True),
                        (np.array([3, 4, 5, 6, 7, 8]), False)]:
        out, _ = m(x, is_causal=causal, positions=pos)
        np.testing.assert_allclose(out, manual_mha(m, x, np.arange(6) if pos is None else pos, causal), atol=1e-12)
    out, _ = m(x, is_causal=True)
    np.testing.assert_allclose(out, manual_mha(m, x, np.arange(6), True), atol=1e-12)
    # unbatched (L, D) and (L, B, D) inputs
    np.testing.assert_allclose(m(x[1], is_causal=True)[0], out[1], atol=1e-12)
    mt = qkv.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, dtype=np.float64, batch_first=False,
                                rope=m.rope).load(**m.parameters())
    np.testing.assert_allclose(mt(x.transpose(1, 0, 2), is_causal=True)[0].transpose(1, 0, 2), out, atol=1e-12)


def test_uniform_shift_of_positions_changes_nothing(rng):
    """RoPE is relative: moving every token by the same amount leaves the attention output unchanged."""
    m = qkv.MultiHeadAttention(16, 2, dtype=np.float64, seed=0, rope=qkv.RoPE())
    x = rng.standard_normal((2, 5, 16))
    a, wa = m(x, is_causal=True, need_weights=True)
    b, wb = m(x, is_causal=True, need_weights=True, positions=np.arange(5) + 1000)
    np.testing.assert_allclose(a, b, atol=1e-10)
    np.testing.assert_allclose(wa, wb, atol=1e-10)


def test_pipeline_attend_with_rope(rng):
    """qkv.pipeline.attend(rope=RoPE(...)) rotates q and k (Q_rot, K_rot) before the scores."""
    from qkv import pipeline
    r = qkv.RoPE(500.0, "interleaved")
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (4, 6, 6))
    with qkv.trace() as t:
        out, _, _ = pipeline.attend(q, k, v, scale=8 ** -0.5, rope=r, q_positions=np.arange(2, 6),
                                    k_positions=np.arange(6))
    assert t.names()[:3] == ["Q_rot", "K_rot", "scores"]
    want = qkv.scaled_dot_product_attention(r(q, np.arange(2, 6)), r(k), v)
    np.testing.assert_allclose(out, want, atol=1e-12)


# ------------------------------------------------------------------------------------- cached decoding
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("steps", [[1] * 8, [1, 2, 3, 2], [3, 3, 2], [2, 1, 3, 1, 1]])
def test_cached_decoding_with_rope_equals_full_forward(style, num_kv_heads, steps, rng):
    m = qkv.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, dtype=np.float64, seed=2,
                               rope=qkv.RoPE(10000.0, style))
    m.load(b_Q=rng.standard_normal(32), b_K=rng.standard_normal(m.b_K.shape))
    T = sum(steps)
    x = rng.standard_normal((2, T, 32))
    full, _ = m(x, is_causal=True)
    cache, outs, t = qkv.KVCache(), [], 0
    for n in steps:
        assert cache.offset == t == len(cache)
        out, _ = m(x[:, t:t + n], is_causal=True, cache=cache)
        outs.append(out)
        t += n
    assert cache.offset == T
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-10)
    # the cache holds the keys already rotated, at their true positions
    with qkv.trace() as tr:
        m(x, is_causal=True)
    np.testing.assert_allclose(cache.keys, tr["K_rot"].array, atol=1e-12)
    cache.reset()
    assert cache.offset == 0 and len(cache) == 0


def test_cached_decoding_with_explicit_positions(rng):
    """Explicit positions override the cache offset (e.g. a sequence that starts at position 100)."""
    m = qkv.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=np.float64, seed=4, rope=qkv.RoPE())
    x = rng.standard_normal((1, 6, 16))
    pos = np.arange(100, 106)
    full, _ = m(x, is_causal=True, positions=pos)
    cache = qkv.KVCache()
    a, _ = m(x[:, :4], is_causal=True, cache=cache, positions=pos[:4])
    b, _ = m(x[:, 4:], is_causal=True, cache=cache, positions=np.array([[104, 105]]))
    np.testing.assert_allclose(np.concatenate([a, b], axis=1), full, atol=1e-10)
    # unbatched decoding, one token at a time, default positions from the offset
    full, _ = m(x[0], is_causal=True)
    cache = qkv.KVCache()
    steps = [m(x[0, i:i + 1], is_causal=True, cache=cache)[0] for i in range(6)]
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-10)


# ------------------------------------------------------------------------------------- bad input
def test_rope_bad_input():
    x = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=r"x: .*even last dimension E, got 5"):
        rope(np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"x: expected at least 2 dimensions"):
        rope(np.zeros(4))
    with pytest.raises(TypeError, match=r"x: expected dtype float"):
        rope(np.zeros((3, 4), int))
    with pytest.raises(TypeError, match=r"positions: expected integer positions, got dtype float64"):
        rope(x, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(TypeError, match=r"positions: expected integer positions, got dtype bool"):
        rope(x, np.array([True, False, True]))
    with pytest.raises(ValueError, match=r"positions: expected non-negative integers, got -1"):
        rope(x, np.array([0, -1, 2]))
    with pytest.raises(ValueError, match=r"positions: expected shape \(T,\) = \(3,\).*got \(4,\)"):
        rope(x, np.arange(4))
    with pytest.raises(ValueError, match=r"positions: expected shape .*got \(3, 3\)"):
        rope(x, np.zeros((3, 3), int))                                    # batch 3 ≠ 2
    with pytest.raises(ValueError, match=r"positions: expected shape .*got \(2, 1, 3\)"):
        rope(x, np.zeros((2, 1, 3), int))                                  # more dims than x
    with pytest.raises(ValueError, match=r"positions: expected shape .*got \(\)"):
        rope(x, 3)
    with pytest.raises(TypeError, match=r"positions: expected an integer numpy array"):
        rope(x, "012")
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"theta: expected a finite number > 0, got"):
            rope(x, theta=bad)
    with pytest.raises(TypeError, match=r"theta: expected a positive real number, got str"):
        rope(x, theta="10000")
    with pytest.raises(ValueError, match=r"style: expected one of \('neox', 'interleaved'\), got 'gptj'"):
        rope(x, style="gptj")
    with pytest.raises(TypeError, match=r"style: expected one of"):
        rope(x, style=None)
    with pytest.raises(ValueError, match=r"theta: expected a finite number > 0, got -2"):
        qkv.RoPE(-2)
    with pytest.raises(ValueError, match=r"style: expected one of .*got 'halves'"):
        qkv.RoPE(style="halves")
    with pytest.raises(ValueError, match=r"E: .*even width, got 3"):
        qkv.RoPE().cos_sin(np.arange(2), 3)
    with pytest.raises(dataclasses_frozen_error()):
        qkv.RoPE().theta = 5.0


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_mha_rope_bad_input(rng):
    with pytest.raises(TypeError, match=r"rope: expected a qkv.RoPE or None, got str"):
        qkv.MultiHeadAttention(16, 2, rope="neox")
    with pytest.raises(TypeError, match=r"rope: expected a qkv.RoPE or None, got function"):
        qkv.MultiHeadAttention(16, 2, rope=rope)
    with pytest.raises(ValueError, match=r"rope: .*even head width, got head_dim = embed_dim / num_heads = 3"):
        qkv.MultiHeadAttention(12, 4, rope=qkv.RoPE())
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    plain = qkv.MultiHeadAttention(16, 2, seed=0)
    with pytest.raises(ValueError, match=r"positions: only used with rope"):
        plain(x, positions=np.arange(5))
    m = qkv.MultiHeadAttention(16, 2, seed=0, rope=qkv.RoPE())
    with pytest.raises(ValueError, match=r"positions: expected shape \(5,\) or \(2, 5\).*got \(4,\)"):
        m(x, positions=np.arange(4))
    with pytest.raises(ValueError, match=r"positions: expected shape \(5,\) or \(2, 5\).*got \(3, 5\)"):
        m(x, positions=np.zeros((3, 5), int))
    with pytest.raises(ValueError, match=r"positions: expected shape \(5,\) .*got \(1, 5\)"):
        m(x[0], positions=np.zeros((1, 5), int))                           # unbatched: (L,) only
    with pytest.raises(TypeError, match=r"positions: expected an integer numpy array, got float64"):
        m(x, positions=np.arange(5.0))
    with pytest.raises(ValueError, match=r"positions: expected non-negative integers, got -2"):
        m(x, positions=np.arange(5) - 2)
    with pytest.raises(ValueError, match=r"key: rope applies to self-attention only"):
        m(x, x[:, :3])                                                      # cross-attention is rejected


# ------------------------------------------------------------------------------------- trace
def test_trace_records_rotated_q_and_k(rng):
    m = qkv.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=np.float64, seed=0, rope=qkv.RoPE(style="interleaved"))
    x = rng.standard_normal((1, 5, 16))
    with qkv.trace() as t:
        m(x, positions=np.arange(5) + 7)
    names = t.names()
    assert names.index("Q_heads") < names.index("Q_rot") and names.index("K_heads") < names.index("K_rot")
    assert names.index("K_rot") < names.index("scores")
    q_rot, k_rot = t["Q_rot"], t["K_rot"]
    assert q_rot.op == "rope" and q_rot.shape == (1, 4, 5, 4) and k_rot.shape == (1, 2, 5, 4)
    assert q_rot.params == {"style": "interleaved", "theta": 10000.0}
    np.testing.assert_array_equal(q_rot.operands["x"], t["Q_heads"].array)
    np.testing.assert_array_equal(np.squeeze(q_rot.operands["positions"]), np.arange(7, 12))
    np.testing.assert_allclose(q_rot.array, complex_rope(t["Q_heads"].array, np.arange(7, 12), 10000.0), atol=1e-12)
    # without rope there is no rotation step
    with qkv.trace() as t:
        qkv.MultiHeadAttention(16, 4, seed=0)(x)
    assert "Q_rot" not in t.names()
