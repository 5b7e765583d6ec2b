"""qkv.mods and qkv.create_block_mask: each mod against a hand-written mask, block kinds against exact
evaluation, ALiBi slopes against BLOOM's and the paper's code, derivatives against finite differences, and
every bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import mods
from qkv.blockmask import EMPTY, FULL, PARTIAL
from qkv.pipeline import indices


def dense(mod, L, S, lead=(1, 1)):
    """The mod evaluated element by element: bool lead + (L, S)."""
    b, h, q_idx, kv_idx = indices(lead, L, S)
    return np.broadcast_to(mods.call_mask_mod(mod, b, h, q_idx, kv_idx), lead + (L, S))


def drawn(picture: str) -> np.ndarray:
    """An ASCII-drawn mask: one line per query, '1' may attend, '.' may not."""
    return np.array([[c == "1" for c in line.split()] for line in picture.strip().splitlines()])


def exact_kinds(m: np.ndarray, bs: int) -> np.ndarray:
    """Block kinds of a dense (…, L, S) mask, by looking at every element."""
    L, S = m.shape[-2:]
    nq, nk = -(-L // bs), -(-S // bs)
    out = np.empty(m.shape[:-2] + (nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            blk = m[..., i * bs:(i + 1) * bs, j * bs:(j + 1) * bs]
            out[..., i, j] = np.where(blk.all(axis=(-1, -2)), FULL, np.where(blk.any(axis=(-1, -2)), PARTIAL, EMPTY))
    return out


# ============================================================================ mask mods against drawings
def test_causal_drawn():
    assert np.array_equal(dense(mods.causal(), 4, 4)[0, 0], drawn("""
        1 . . .
        1 1 . .
        1 1 1 .
        1 1 1 1"""))
    # L != S: top-left, as torch's flex causal mod (q_idx >= kv_idx)
    assert np.array_equal(dense(mods.causal(), 2, 4)[0, 0], drawn("""
        1 . . .
        1 1 . ."""))


def test_sliding_window_drawn():
    assert np.array_equal(dense(mods.sliding_window(3), 5, 5)[0, 0], drawn("""
        1 . . . .
        1 1 . . .
        1 1 1 . .
        . 1 1 1 .
        . . 1 1 1"""))
    assert np.array_equal(dense(mods.sliding_window(1), 3, 3)[0, 0], np.eye(3, dtype=bool))


def test_prefix_lm_drawn():
    assert np.array_equal(dense(mods.prefix_lm(2), 5, 5)[0, 0], drawn("""
        1 1 . . .
        1 1 . . .
        1 1 1 . .
        1 1 1 1 .
        1 1 1 1 1"""))
    assert np.array_equal(dense(mods.prefix_lm(0), 6, 6), dense(mods.causal(), 6, 6))


def test_document_drawn():
    assert np.array_equal(dense(mods.document([0, 0, 1, 1, 1]), 5, 5)[0, 0], drawn("""
        1 1 . . .
        1 1 . . .
        . . 1 1 1
        . . 1 1 1
        . . 1 1 1"""))
    causal_doc = mods.and_masks(mods.causal(), mods.document_from_lengths([2, 3]))
    assert np.array_equal(dense(causal_doc, 5, 5)[0, 0], drawn("""
        1 . . . .
        1 1 . . .
        . . 1 . .
        . . 1 1 .
        . . 1 1 1"""))


def test_streaming_llm_drawn():
    m = mods.or_masks(mods.sinks(2), mods.sliding_window(2))
    assert np.array_equal(dense(m, 6, 6)[0, 0], drawn("""
        1 1 . . . .
        1 1 . . . .
        1 1 1 . . .
        1 1 1 1 . .
        1 1 . 1 1 .
        1 1 . . 1 1"""))


@pytest.mark.parametrize("L,S", [(1, 1), (5, 9), (9, 5), (12, 12)])
def test_mask_mods_equal_their_definition(L, S):
    """Each mask mod against its definition written as Python loops over integers."""
    ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3][:max(L, S)])
    cases = {
        "causal": (mods.causal(), lambda i, j: j <= i),
        "window": (mods.sliding_window(3), lambda i, j: i - 3 + 1 <= j <= i),
        "prefix": (mods.prefix_lm(3), lambda i, j: j < 3 or j <= i),
        "sinks": (mods.sinks(2), lambda i, j: j < 2),
        "document": (mods.document(ids), lambda i, j: ids[i] == ids[j]),
        "and": (mods.and_masks(mods.causal(), mods.document(ids)), lambda i, j: j <= i and ids[i] == ids[j]),
        "or": (mods.or_masks(mods.sinks(1), mods.sliding_window(2)), lambda i, j: j < 1 or 0 <= i - j < 2),
    }
    for name, (mod, rule) in cases.items():
        want = np.array([[rule(i, j) for j in range(S)] for i in range(L)], dtype=bool)
        assert np.array_equal(dense(mod, L, S)[0, 0], want), name


def test_document_per_batch_and_from_lengths():
    ids = np.array([[0, 0, 1, 1], [0, 1, 1, 1]])
    m = dense(mods.document(ids), 4, 4, lead=(2, 3))
    for b in range(2):
        want = ids[b][:, None] == ids[b][None, :]
        assert all(np.array_equal(m[b, h], want) for h in range(3))
    assert np.array_equal(dense(mods.document_from_lengths([3, 5, 2]), 10, 10),
                          dense(mods.document(np.repeat(np.arange(3), [3, 5, 2])), 10, 10))


# ============================================================================================ block kinds
def _builtin(name, n):
    """A built-in mod for sequences of n positions."""
    r = np.random.default_rng(n)
    lengths = r.integers(1, 40, size=n)
    sorted_ids = np.repeat(np.arange(n), lengths)[:n]
    return {"causal": mods.causal(), "window1": mods.sliding_window(1), "window5": mods.sliding_window(5),
            "window40": mods.sliding_window(40), "prefix0": mods.prefix_lm(0), "prefix7": mods.prefix_lm(7),
            "prefix100": mods.prefix_lm(100), "sinks0": mods.sinks(0), "sinks4": mods.sinks(4),
            "document": mods.document(sorted_ids)}[name]


BUILTINS = ["causal", "window1", "window5", "window40", "prefix0", "prefix7", "prefix100", "sinks0", "sinks4",
            "document"]


@settings(max_examples=120)
@given(name=st.sampled_from(BUILTINS), L=st.integers(1, 300), S=st.integers(1, 300),
       bs=st.sampled_from([1, 3, 16, 64, 128]))
def test_builtin_block_kinds_are_exact(name, L, S, bs):
    mod = _builtin(name, max(L, S))
    bm = qkv.create_block_mask(mod, None, None, L, S, BLOCK_SIZE=bs)
    assert bm.kinds.shape == (1, 1, -(-L // bs), -(-S // bs))
    assert np.array_equal(bm.kinds[0, 0], exact_kinds(dense(mod, L, S)[0, 0], bs))


@settings(max_examples=80)
@given(L=st.integers(1, 200), S=st.integers(1, 200), bs=st.sampled_from([1, 5, 16, 64]),
       combo=st.sampled_from(["streaming", "causal_doc", "window_or_prefix", "unsorted_doc", "and_or"]),
       seed=st.integers(0, 1000))
def test_combined_block_kinds_are_conservative(L, S, bs, combo, seed):
    """and/or of built-ins (and documents whose ids are not sorted): EMPTY only where nothing is allowed,
    FULL only where everything is; never wrong, perhaps PARTIAL where exact evaluation says otherwise."""
    n = max(L, S)
    r = np.random.default_rng(seed)
    ids = np.sort(r.integers(0, 5, n))
    mod = {"streaming": mods.or_masks(mods.sinks(4), mods.sliding_window(9)),
           "causal_doc": mods.and_masks(mods.causal(), mods.document(ids)),
           "window_or_prefix": mods.or_masks(mods.prefix_lm(6), mods.sliding_window(3)),
           "unsorted_doc": mods.document(r.integers(0, 4, n)),
           "and_or": mods.and_masks(mods.or_masks(mods.sinks(2), mods.sliding_window(17)), mods.document(ids)),
           }[combo]
    kinds = qkv.create_block_mask(mod, None, None, L, S, BLOCK_SIZE=bs).kinds[0, 0]
    exact = exact_kinds(dense(mod, L, S)[0, 0], bs)
    assert not np.any((kinds == EMPTY) & (exact != EMPTY))
    assert not np.any((kinds == FULL) & (exact != FULL))
    if combo == "causal_doc":                     # and of two exact mods: FULL is exact (all = all ∧ all)
        assert np.array_equal(kinds == FULL, exact == FULL)


@settings(max_examples=40)
@given(L=st.integers(1, 100), S=st.integers(1, 100), bs=st.sampled_from([1, 7, 16]), seed=st.integers(0, 99))
def test_custom_mod_kinds_are_evaluated_exactly(L, S, bs, seed):
    r = np.random.default_rng(seed)
    table = r.random((2, 3, L, S)) < 0.3

    def lookup(b, h, q_idx, kv_idx):
        return table[b, h, q_idx, kv_idx]
    bm = qkv.create_block_mask(lookup, 2, 3, L, S, BLOCK_SIZE=bs)
    assert np.array_equal(bm.kinds, exact_kinds(table, bs))
    assert np.array_equal(bm.dense(), table)


def test_builtin_kinds_never_evaluate_the_mod_elementwise():
    seen = []
    base = mods.sliding_window(8)

    def spy(b, h, q_idx, kv_idx):
        seen.append(np.broadcast_shapes(q_idx.shape, kv_idx.shape))
        return base(b, h, q_idx, kv_idx)
    mod = mods.MaskMod(spy, name="spy", block_kinds=base.block_kinds)
    bm = qkv.create_block_mask(mod, None, None, 1000, 1000, BLOCK_SIZE=128)
    assert seen == [(1, 1)]                       # only the size probe at the far corner
    assert bm.to_string().splitlines()[:2] == ["◩ · · · · · · ·", "◩ ◩ · · · · · ·"]


def test_per_batch_document_kinds_and_broadcast():
    ids = np.array([[0] * 8 + [1] * 8, [0] * 16])
    bm = qkv.create_block_mask(mods.document(ids), 2, None, 16, 16, BLOCK_SIZE=8)
    assert bm.kinds.shape == (2, 1, 2, 2)
    assert bm.kinds[0, 0].tolist() == [[FULL, EMPTY], [EMPTY, FULL]]
    assert bm.kinds[1, 0].tolist() == [[FULL, FULL], [FULL, FULL]]
    assert bm.kind(0, 3, 0, 8, 8, 16) is None and bm.kind(1, 3, 0, 8, 8, 16) == "full"
    assert bm.kind(0, 0, 4, 12, 4, 12) == "partial"


def test_built_broadcast_calls_the_mod_with_index_zero():
    """B/H None (or 1, used for more): the mod sees b = 0 / h = 0, in the kinds and in the dense mask alike."""
    def head_dependent(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (h > 0)
    for H in (None, 1):
        bm = qkv.create_block_mask(head_dependent, None, H, 6, 6, BLOCK_SIZE=2)
        m = np.broadcast_to(bm.dense((2, 4), 6, 6), (2, 4, 6, 6))
        assert all(np.array_equal(m[b, h], np.tril(np.ones((6, 6), bool))) for b in range(2) for h in range(4))
        assert [int(x) for x in bm.index_arrays(1, 3)] == [0, 0]
    bm = qkv.create_block_mask(head_dependent, None, 4, 6, 6, BLOCK_SIZE=2)
    assert np.broadcast_to(bm.dense((2, 4), 6, 6), (2, 4, 6, 6))[1, 1].all()
    assert [int(x) for x in bm.index_arrays(1, 3)] == [0, 3]


def test_sparsity_and_repr():
    bm = qkv.create_block_mask(mods.causal(), None, None, 256, 256, BLOCK_SIZE=64)
    assert bm.sparsity() == pytest.approx(100 * 6 / 16)
    assert "causal()" in repr(bm) and "BLOCK_SIZE=64" in repr(bm)


# ============================================================================================ traits
def _mask_cases():
    lengths = [5, 9, 6]
    return {"causal": mods.causal(), "window": mods.sliding_window(4), "prefix": mods.prefix_lm(3),
            "document": mods.document_from_lengths(lengths), "sinks": mods.sinks(2),
            "streaming": mods.or_masks(mods.sinks(2), mods.sliding_window(4)),
            "causal_document": mods.and_masks(mods.causal(), mods.document_from_lengths(lengths)),
            "window_or_causal": mods.or_masks(mods.sliding_window(3), mods.causal()),
            "window_and_custom": mods.and_masks(mods.sliding_window(3), lambda b, h, q, k: (q + k) % 3 != 0)}


@pytest.mark.parametrize("name", list(_mask_cases()))
def test_mask_traits_are_kept_by_the_mods(name):
    """What each mod promises (qkv.mods.MaskTraits, read by the engine instead of its name) holds everywhere."""
    mod = _mask_cases()[name]
    t = mod.traits
    assert isinstance(t, mods.MaskTraits)
    m = dense(mod, 20, 20)[0, 0]
    i, j = np.arange(20)[:, None], np.arange(20)[None, :]
    if t.invariant:                                          # a function of i − j: constant along diagonals
        for d in range(-19, 20):
            assert len(set(np.diagonal(m, -d).tolist())) == 1, d
    if t.diagonal:
        assert np.diagonal(m).all()
    if t.causal:
        assert not m[j > i].any()


def test_mask_traits_of_the_builtins_and_their_combinations():
    T = mods.MaskTraits
    c = _mask_cases()
    assert c["causal"].traits == c["window"].traits == T(True, True, True)
    assert c["prefix"].traits == c["document"].traits == T(False, True, False)
    assert c["sinks"].traits == T()
    assert c["streaming"].traits == T(False, True, False)          # or: the diagonal if either allows it
    assert c["causal_document"].traits == T(False, True, True)     # and: causal if either is
    assert c["window_or_causal"].traits == T(True, True, True)
    assert c["window_and_custom"].traits == T(False, False, True)  # a child without traits knows nothing
    assert mods.as_mask_mod(lambda b, h, q, k: q >= k).traits is None
    assert mods.MaskMod(lambda b, h, q, k: q >= k, name="causal").traits is None   # a name promises nothing
    with pytest.raises(TypeError, match="traits"):
        mods.MaskMod(lambda b, h, q, k: q >= k, traits=(True, True, True))


def test_score_traits_describe_what_the_mods_compute():
    slopes = mods.alibi_slopes(4)
    b, h, q_idx, kv_idx = indices((1, 4), 6, 7)
    s = np.random.default_rng(3).standard_normal((1, 4, 6, 7)) * 3
    a = mods.alibi(slopes)
    assert np.array_equal(a.traits.bias_slopes, slopes) and a.traits.cap is None and not a.traits.elementwise
    want = s + a.traits.bias_slopes[:, None, None] * (kv_idx - q_idx)
    np.testing.assert_allclose(mods.call_score_mod(a, s, b, h, q_idx, kv_idx), want, rtol=1e-15)
    c = mods.softcap(5.0)
    assert c.traits.cap == 5.0 and c.traits.bias_slopes is None and c.traits.elementwise
    np.testing.assert_allclose(mods.call_score_mod(c, s, b, h, q_idx, kv_idx), 5.0 * np.tanh(s / 5.0), rtol=1e-15)
    chain = mods.compose(a, c)
    assert chain.traits.chain == (a, c) and not chain.traits.elementwise
    assert mods.compose(c, mods.softcap(2.0)).traits.elementwise
    custom = mods.ScoreMod(lambda s, b, h, q, k: s, grad=lambda s, b, h, q, k: np.ones((), s.dtype), name="alibi")
    assert custom.traits is None and mods.as_score_mod(lambda s, b, h, q, k: s).traits is None
    assert not mods.compose(custom, c).traits.elementwise
    with pytest.raises(TypeError, match="traits"):
        mods.ScoreMod(lambda s, b, h, q, k: s, traits={"cap": 5.0})


def _paper_slopes(n):
    """The ALiBi repository's get_slopes (ofirpress/attention_with_linear_biases), as written there."""
    def get_slopes_power_of_2(n):
        start = (2 ** (-2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]
    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + _paper_slopes(2 * closest_power_of_2)[0::2][:n - closest_power_of_2])


def test_alibi_slopes():
    assert np.array_equal(mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    assert mods.alibi_slopes(8).dtype == np.float64
    for H in (1, 2, 3, 5, 6, 7, 12, 16, 20, 24, 32, 40):
        np.testing.assert_allclose(mods.alibi_slopes(H), _paper_slopes(H), rtol=1e-14)
    np.testing.assert_allclose(mods.alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])


def test_alibi_values_and_grad():
    slopes = mods.alibi_slopes(4)
    b, h, q_idx, kv_idx = indices((2, 4), 5, 7)
    s = np.random.default_rng(0).standard_normal((2, 4, 5, 7))
    out = mods.call_score_mod(mods.alibi(slopes), s, b, h, q_idx, kv_idx)
    want = s + slopes[:, None, None] * (np.arange(7)[None, None, :] - np.arange(5)[None, :, None])
    np.testing.assert_allclose(out, want, rtol=1e-15)
    g = mods.score_mod_grad(mods.alibi(slopes), s, b, h, q_idx, kv_idx)
    assert np.all(np.broadcast_to(g, s.shape) == 1)


def _fd_check(mod, s, b, h, q_idx, kv_idx, eps=1e-6):
    g = np.broadcast_to(mods.score_mod_grad(mod, s, b, h, q_idx, kv_idx), s.shape)
    up = mods.call_score_mod(mod, s + eps, b, h, q_idx, kv_idx)
    down = mods.call_score_mod(mod, s - eps, b, h, q_idx, kv_idx)
    np.testing.assert_allclose(g, (up - down) / (2 * eps), rtol=1e-6, atol=1e-8)


def test_softcap_values_and_grad_vs_finite_differences():
    b, h, q_idx, kv_idx = indices((2, 3), 6, 9)
    s = np.random.default_rng(1).standard_normal((2, 3, 6, 9)) * 20
    out = mods.call_score_mod(mods.softcap(5.0), s, b, h, q_idx, kv_idx)
    np.testing.assert_allclose(out, 5.0 * np.tanh(s / 5.0), rtol=1e-15)
    assert np.all(np.abs(out) < 5.0)
    _fd_check(mods.softcap(5.0), s, b, h, q_idx, kv_idx)
    _fd_check(mods.softcap(0.3), s / 20, b, h, q_idx, kv_idx)


def test_compose_order_and_grad_vs_finite_differences():
    b, h, q_idx, kv_idx = indices((1, 4), 6, 6)
    s = np.random.default_rng(2).standard_normal((1, 4, 6, 6)) * 3
    slopes = mods.alibi_slopes(4)
    c = mods.compose(mods.alibi(slopes), mods.softcap(2.0))
    bias = slopes[:, None, None] * (np.arange(6)[None, None, :] - np.arange(6)[None, :, None])
    np.testing.assert_allclose(mods.call_score_mod(c, s, b, h, q_idx, kv_idx), 2.0 * np.tanh((s + bias) / 2.0),
                               rtol=1e-14)
    _fd_check(c, s, b, h, q_idx, kv_idx)
    sq = mods.ScoreMod(lambda x, b, h, i, j: x * x, grad=lambda x, b, h, i, j: 2 * x)
    _fd_check(mods.compose(mods.softcap(1.5), sq, mods.alibi(slopes)), s, b, h, q_idx, kv_idx)
    assert not mods.compose(mods.softcap(1.0), lambda x, b, h, i, j: x).has_grad


# =========================================================================================== bad input
@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError),
                                     ("3", TypeError), (None, TypeError)])
def test_window_bad(bad, exc):
    with pytest.raises(exc, match="window"):
        mods.sliding_window(bad)


@pytest.mark.parametrize("builder,arg", [("prefix_lm", "prefix_len"), ("sinks", "n")])
def test_prefix_and_sinks_bad(builder, arg):
    fn = getattr(mods, builder)
    with pytest.raises(ValueError, match=arg):
        fn(-1)
    with pytest.raises(TypeError, match=arg):
        fn(1.5)
    with pytest.raises(TypeError, match=arg):
        fn(True)


def test_document_bad():
    with pytest.raises(TypeError, match="doc_ids: expected integers, got dtype float64"):
        mods.document([0.0, 1.0])
    with pytest.raises(TypeError, match="doc_ids.*bool"):
        mods.document(np.array([True, False]))
    with pytest.raises(ValueError, match=r"doc_ids: expected shape \(S,\) or \(B, S\).*\(1, 2, 3\)"):
        mods.document(np.zeros((1, 2, 3), int))
    with pytest.raises(ValueError, match="doc_ids"):
        mods.document([])
    with pytest.raises(ValueError, match=r"doc_ids: expected 8 document ids .*got 6"):
        qkv.create_block_mask(mods.document([0, 0, 1, 1, 1, 1]), None, None, 8, 8)
    with pytest.raises(ValueError, match=r"doc_ids: expected 9 document ids .*got 8"):
        qkv.create_block_mask(mods.and_masks(mods.causal(), mods.document(np.zeros(8, int))), None, None, 9, 4)
    with pytest.raises(ValueError, match=r"doc_ids: expected shape \(3, 4\)"):
        qkv.create_block_mask(mods.document(np.zeros((2, 4), int)), 3, None, 4, 4)
    with pytest.raises(ValueError, match=r"doc_ids: expected shape \(1, 4\).*B=2"):
        qkv.create_block_mask(mods.document(np.zeros((2, 4), int)), None, None, 4, 4)


def test_lengths_bad():
    with pytest.raises(ValueError, match=r"lengths: expected positive lengths, got \[3, 0, 2\]"):
        mods.document_from_lengths([3, 0, 2])
    with pytest.raises(ValueError, match="lengths"):
        mods.document_from_lengths([-1, 2])
    with pytest.raises(TypeError, match="lengths: expected integers"):
        mods.document_from_lengths([1.5, 2])
    with pytest.raises(ValueError, match="lengths"):
        mods.document_from_lengths([[1, 2]])
    with pytest.raises(ValueError, match="lengths"):
        mods.document_from_lengths([])


@pytest.mark.parametrize("cap,exc", [(0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                     (math.nan, ValueError), (True, TypeError), ("5", TypeError), (None, TypeError)])
def test_softcap_bad(cap, exc):
    with pytest.raises(exc, match="cap: expected a finite number > 0"):
        mods.softcap(cap)


def test_alibi_bad():
    with pytest.raises(ValueError, match=r"slopes: expected shape \(num_heads,\), got \(2, 4\)"):
        mods.alibi(np.ones((2, 4)))
    with pytest.raises(ValueError, match="slopes"):
        mods.alibi([])
    with pytest.raises(ValueError, match="slopes: expected finite"):
        mods.alibi([1.0, np.inf])
    with pytest.raises(TypeError, match="slopes: expected numbers"):
        mods.alibi(["a", "b"])
    for bad, exc in ((0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="num_heads"):
            mods.alibi_slopes(bad)
    q = np.zeros((1, 8, 4, 2))
    with pytest.raises(ValueError, match=r"slopes: expected one slope per query head \(H=8\), got 4"):
        qkv.flex_attention(q, q, q, score_mod=mods.alibi(mods.alibi_slopes(4)))


def test_combinators_bad():
    with pytest.raises(ValueError, match="and_masks: expected at least one"):
        mods.and_masks()
    with pytest.raises(ValueError, match="or_masks: expected at least one"):
        mods.or_masks()
    with pytest.raises(ValueError, match="compose: expected at least one"):
        mods.compose()
    with pytest.raises(TypeError, match=r"and_masks\[1\]: expected a callable"):
        mods.and_masks(mods.causal(), 3)
    with pytest.raises(TypeError, match=r"compose\[0\]: expected a callable"):
        mods.compose("softcap")
    with pytest.raises(TypeError, match="grad: expected a callable"):
        mods.ScoreMod(lambda s, b, h, i, j: s, grad=1.0)
    with pytest.raises(TypeError, match="mask_mod: expected a callable"):
        qkv.create_block_mask(None, None, None, 4, 4)


@pytest.mark.parametrize("name,value,exc", [("B", 0, ValueError), ("H", 1.5, TypeError), ("Q_LEN", 0, ValueError),
                                            ("KV_LEN", -3, ValueError), ("BLOCK_SIZE", 0, ValueError),
                                            ("BLOCK_SIZE", True, TypeError)])
def test_create_block_mask_bad_sizes(name, value, exc):
    kw = dict(B=None, H=None, Q_LEN=8, KV_LEN=8, BLOCK_SIZE=4)
    kw[name] = value
    with pytest.raises(exc, match=name):
        qkv.create_block_mask(mods.causal(), **kw)


@pytest.mark.parametrize("fn,exc,match", [
    (lambda b, h, i, j: (i >= j).astype(int), TypeError, "mask_mod: expected it to return dtype bool.*int64"),
    (lambda b, h, i, j: (i >= j).astype(float), TypeError, "mask_mod: expected it to return dtype bool.*float64"),
    (lambda b, h, i, j: 1.0, TypeError, "mask_mod: expected it to return a numpy bool array, got float"),
    (lambda b, h, i, j: [True], TypeError, "mask_mod: expected it to return a numpy bool array, got list"),
    (lambda b, h, i, j: np.ones((3, 5), bool), ValueError, "mask_mod: expected a result broadcastable to"),
    (lambda b, h, i, j: np.ones((2, 1, 1, 1, 1), bool), ValueError, "mask_mod: expected a result broadcastable"),
])
def test_mask_mod_returning_the_wrong_thing(fn, exc, match):
    with pytest.raises(exc, match=match):
        qkv.create_block_mask(fn, None, None, 8, 8, BLOCK_SIZE=4)


@pytest.mark.parametrize("fn,exc,match", [
    (lambda s, b, h, i, j: (s > 0).astype(np.int64), TypeError, "score_mod: expected it to return floating scores"),
    (lambda s, b, h, i, j: s > 0, TypeError, "score_mod: expected it to return floating scores.*bool"),
    (lambda s, b, h, i, j: list(s), TypeError, "score_mod: expected it to return a numpy array of scores, got list"),
    (lambda s, b, h, i, j: s[..., :1, :], None, None),                         # broadcasts: accepted
    (lambda s, b, h, i, j: s[..., :2], ValueError, r"score_mod: expected a result of the scores' shape"),
    (lambda s, b, h, i, j: np.ones((3,) + s.shape), ValueError, "score_mod: expected a result of the scores'"),
    (lambda s, b, h, i, j: s * np.nan, ValueError, "score_mod: expected finite scores or −inf"),
    (lambda s, b, h, i, j: np.where(i == j, np.inf, s), ValueError, "score_mod: expected finite scores or −inf"),
])
def test_score_mod_returning_the_wrong_thing(fn, exc, match):
    q = np.random.default_rng(0).standard_normal((1, 2, 4, 3))
    if exc is None:
        qkv.flex_attention(q, q, q, score_mod=fn)
        return
    with pytest.raises(exc, match=match):
        qkv.flex_attention(q, q, q, score_mod=fn)


def test_score_mod_grad_returning_the_wrong_thing():
    b, h, q_idx, kv_idx = indices((1, 2), 4, 4)
    s = np.zeros((1, 2, 4, 4))
    for grad, exc, match in ((lambda *a: "x", TypeError, "grad returned str"),
                             (lambda *a: np.ones((5, 5)), ValueError, "grad returned shape"),
                             (lambda *a: np.full(s.shape, np.nan), ValueError, "expected finite derivatives")):
        with pytest.raises(exc, match=match):
            mods.score_mod_grad(mods.ScoreMod(lambda x, *a: x, grad=grad), s, b, h, q_idx, kv_idx)
    with pytest.raises(ValueError, match="no derivative"):
        mods.score_mod_grad(mods.ScoreMod(lambda x, *a: x), s, b, h, q_idx, kv_idx)
