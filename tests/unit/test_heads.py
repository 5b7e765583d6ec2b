"""Heads at a glance, rollout and flow (issue 11): qkv.viz.head_kinds, rollout, attention_flow; qkv model
--heads-summary / --rollout."""
import numpy as np
import pytest

from qkv import viz
from qkv.viz import heads as vh

T = 8
TOKENS = ["[CLS]", "a", "b", "a", "c", "d", "e", "[SEP]"]


def _head(kind: str) -> np.ndarray:
    """A (T, T) head that is purely one pattern."""
    W = np.zeros((T, T))
    for i in range(T):
        if kind == "previous":
            W[i, max(i - 1, 0)] = 1
        elif kind == "next":
            W[i, min(i + 1, T - 1)] = 1
        elif kind == "same":
            W[i, i] = 1
        elif kind == "sink":
            W[i, 0] = 1
        elif kind == "long_range":
            W[i, 6 if i < 3 else 1] = 1             # 6 − 0..2 > 4 and i − 1 > 4 for i ≥ 6; rows 3..5 are near
        elif kind == "broad":
            W[i] = 1 / T
    return W


def test_pure_heads_get_their_kind_and_exact_scores():
    kinds = ["previous", "next", "same", "sink", "broad"]
    A = np.stack([_head(k) for k in kinds])[None]                       # one layer, 5 heads
    hk = viz.head_kinds(A)                                              # no tokens: same = the diagonal
    assert list(hk.kind[0]) == kinds
    np.testing.assert_allclose(hk.scores["previous"][0, 0], 1.0)        # rows 1..7 all on i−1
    np.testing.assert_allclose(hk.scores["next"][0, 1], 1.0)
    np.testing.assert_allclose(hk.scores["same"][0, 2], 1.0)
    np.testing.assert_allclose(hk.scores["sink"][0, 3], 1.0)
    np.testing.assert_allclose(hk.scores["broad"][0, 4], 1.0)           # uniform: entropy = log T
    np.testing.assert_allclose(hk.scores["previous"][0, 2], 0.0)
    np.testing.assert_allclose(hk.scores["sink"][0, 0], 2 / T)          # rows 0 and 1 of the previous head: key 0
    assert hk.heads_of("sink") == [(0, 3, 1.0)]


def test_scores_by_hand_with_tokens_and_specials():
    W = _head("long_range")
    hk = viz.head_kinds([W[None]], TOKENS, near=4)
    # rows 0,1,2 → key 6 (distance 6, 5, 4: only > 4 counts: rows 0 and 1); rows 3..7 → key 1 (distances 2..6:
    # rows 6, 7 count). 4 of 8 rows.
    np.testing.assert_allclose(hk.scores["long_range"][0, 0], 4 / 8)
    same = _head("same")
    same[1] = 0
    same[1, 3] = 1                                                      # "a" (row 1) looks at the other "a"
    hk = viz.head_kinds([same[None]], TOKENS)
    np.testing.assert_allclose(hk.scores["same"][0, 0], 1.0)            # same token, not only the diagonal
    sink = np.zeros((T, T))
    sink[:, 7] = 1                                                      # everything on [SEP]
    hk = viz.head_kinds([sink[None]], TOKENS)
    assert hk.kind[0, 0] == "sink" and hk.sinks == [0, 7]
    np.testing.assert_allclose(hk.scores["long_range"][0, 0], 0.0)      # a sink is not long-range
    half = np.full((T, T), 0.0)
    half[:, :2] = 0.5                                                   # two of 8 keys: entropy log 2 / log 8
    np.testing.assert_allclose(viz.head_kinds([half[None]]).scores["broad"][0, 0], 1 / 3)
    causal = np.tril(np.ones((T, T)))
    causal /= causal.sum(-1, keepdims=True)                             # uniform over what each row may see
    hk = viz.head_kinds([causal[None]])
    np.testing.assert_allclose(hk.scores["broad"][0, 0], 1.0)           # detected causal: n_i = i + 1
    assert hk.kind[0, 0] == "broad" and hk.scores["next"][0, 0] == 0
    np.testing.assert_allclose(viz.head_kinds([causal[None]], causal=False).scores["broad"][0, 0],
                               np.mean([np.log(i + 1) / np.log(T) for i in range(1, T)]) * (T - 1) / T)


def test_a_mixed_head_and_the_chart():
    mix = 0.4 * _head("previous") + 0.35 * _head("sink") + 0.25 * _head("same")
    hk = viz.head_kinds(np.stack([_head("previous"), mix])[:, None])    # 2 layers × 1 head
    assert list(hk.kind[:, 0]) == ["previous", "mixed"]
    chart = hk.chart()
    assert chart.splitlines()[1][6:10] == "P 99"                       # layer 0, head 0: previous, 0.99+
    # mixed (no score ≥ 0.5); its strongest: sink = (1 + 0.75 + 6 × 0.35) / 8 = 0.48 (rows 0 and 1 also put their
    # previous/same weight on key 0), previous = (0.75 + 6 × 0.4) / 7 = 0.45
    np.testing.assert_allclose([hk.scores["sink"][1, 0], hk.scores["previous"][1, 0]], [0.48125, 0.45])
    assert chart.splitlines()[2][6:10] == "s 48"
    assert repr(hk) == "HeadKinds(2 layers × 1 heads: previous=1, mixed=1)"


def test_bad_input():
    with pytest.raises(ValueError, match=r"expected shape \(H, T, T\)"):
        viz.head_kinds([np.ones((2, 3, 4))])
    with pytest.raises(ValueError, match="tokens: expected 8 tokens"):
        viz.head_kinds([_head("same")[None]], ["a"])
    with pytest.raises(ValueError, match="finite non-negative"):
        viz.rollout([-_head("same")[None]])
    with pytest.raises(ValueError, match="head_fusion: expected one of mean, max, min"):
        viz.rollout([_head("same")[None]], head_fusion="median")
    with pytest.raises(TypeError, match="attentions: expected"):
        viz.rollout("nope")


# ----------------------------------------------------------------------------------------------- rollout
A1 = np.array([[1.0, 0.0], [0.5, 0.5]])
A2 = np.array([[0.2, 0.8], [0.0, 1.0]])


def test_rollout_by_hand():
    # Ã = (A + I) renormalised: Ã1 = [[1, 0], [.25, .75]], Ã2 = [[.6, .4], [0, 1]]; R = Ã2 · Ã1
    R = viz.rollout([A1[None], A2[None]])
    np.testing.assert_allclose(R, [[0.7, 0.3], [0.25, 0.75]])
    np.testing.assert_allclose(viz.rollout([A1[None], A2[None]], add_residual=False), A2 @ A1)
    steps = viz.rollout([A1[None], A2[None]], all_layers=True)
    np.testing.assert_allclose(steps[0], [[1, 0], [0.25, 0.75]])
    np.testing.assert_allclose(steps[1], R)


def _reference_rollout(layers, fusion="mean", residual=True):
    """Abnar & Zuidema's recipe written out: 0.5·W_att + 0.5·I, rows renormalised, multiplied layer by layer."""
    n = layers[0].shape[-1]
    result = np.eye(n)
    for A in layers:
        fused = {"mean": A.mean(0), "max": A.max(0), "min": A.min(0)}[fusion]
        a = 0.5 * fused + 0.5 * np.eye(n) if residual else fused
        a = a / a.sum(-1, keepdims=True)
        result = a @ result
    return result


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("residual", [True, False])
def test_rollout_against_a_reference(fusion, residual):
    rng = np.random.default_rng(0)
    layers = [rng.dirichlet(np.ones(7), size=(4, 7)) for _ in range(3)]       # 3 layers × 4 heads × 7 × 7
    R = viz.rollout(layers, add_residual=residual, head_fusion=fusion)
    np.testing.assert_allclose(R, _reference_rollout(layers, fusion, residual), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(R.sum(-1), 1.0)
    # the same as one (layers, H, T, T) array, and as (1, H, T, T) per layer (a model's batch of one)
    np.testing.assert_allclose(viz.rollout(np.stack(layers), residual, fusion), R)
    np.testing.assert_allclose(viz.rollout([a[None] for a in layers], residual, fusion), R)


# ----------------------------------------------------------------------------------------------- flow
def test_flow_by_hand_on_a_tiny_graph():
    pytest.importorskip("networkx")
    # Ã1 = [[1, 0], [.25, .75]], Ã2 = [[.6, .4], [0, 1]]. From output 0 to input 0: through position 0
    # min(.6, 1) = .6, through position 1 min(.4, .25) = .25 → .85; to input 1: only through 1, min(.4, .75) = .4.
    F = viz.attention_flow([A1[None], A2[None]], normalize=False)
    np.testing.assert_allclose(F, [[0.85, 0.4], [0.25, 0.75]])
    np.testing.assert_allclose(viz.attention_flow([A1[None], A2[None]]), [[0.85 / 1.25, 0.4 / 1.25], [0.25, 0.75]])
    np.testing.assert_allclose(viz.attention_flow([A1[None], A2[None]], queries=[1], normalize=False), [[0.25, 0.75]])


def test_two_layer_flow_is_the_sum_of_bottlenecks():
    """Two layers: the paths i → k → j are edge-disjoint, so the max flow is Σ_k min(Ã2[i, k], Ã1[k, j])."""
    nx = pytest.importorskip("networkx")
    rng = np.random.default_rng(1)
    layers = [rng.dirichlet(np.ones(5), size=(3, 5)) for _ in range(2)]
    F = viz.attention_flow(layers, normalize=False)
    a1, a2 = vh._fused(layers, "mean", True)
    expect = np.minimum(a2[:, :, None], a1[None, :, :]).sum(1)                # [i, j] = Σ_k min(a2[i,k], a1[k,j])
    np.testing.assert_allclose(F, expect, rtol=1e-9)
    G = nx.DiGraph()                                                           # and networkx on its own graph
    for l, a in enumerate((a1, a2)):
        for i in range(5):
            for j in range(5):
                G.add_edge(f"{l + 1}/{i}", f"{l}/{j}", capacity=a[i, j])
    assert nx.maximum_flow_value(G, "2/3", "0/1") == pytest.approx(F[3, 1])


def test_flow_refuses_a_graph_too_large():
    layers = [np.full((1, 60, 60), 1 / 60)] * 6
    with pytest.raises(ValueError, match="too large for max-flow"):
        viz.attention_flow(layers)
    with pytest.raises(ValueError, match="queries: expected positions 0..59"):
        viz.attention_flow(layers, queries=[60])
