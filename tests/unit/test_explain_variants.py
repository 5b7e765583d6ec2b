"""The variants in worked examples: RoPE, ALiBi, soft-capping, sliding window, documents, sinks.

Each built-in example's key numbers are worked out by hand here (the arithmetic in the comments), then held to
an independent NumPy formula written in this file, to torch's FlexAttention (CPU) or a dense torch formula,
and RoPE to transformers' ``apply_rotary_pos_emb``. The explainer must write the arithmetic with the recorded
numbers, the checker must accept claims on Q_rot, K_rot, biased and capped with the usual verdicts, and every
new file key must refuse bad values with one line and exit code 2.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.explain import check, explain_query, render
from qkv.explain import examples as ex

VARIANTS = ["rope", "alibi", "softcap", "sliding_window", "document", "sinks"]


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def statuses(report):
    return {(c.name, c.row, c.col): c.status for c in report.claims}


def softmax_rows(x, sink=None):
    """Row softmax with −inf masked entries; with a sink logit the denominator gains exp(sink − max)."""
    m = np.max(x, axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    e = np.exp(x - m)
    total = e.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - m))
    return e / total


def rope_numpy(x, positions, theta, style):
    """RoPE written from the paper: pair k turns by positions × theta^(−2k/E)."""
    E = x.shape[-1]
    ang = np.asarray(positions, float)[:, None] * theta ** (-np.arange(0, E, 2) / E)     # (T, E/2)
    c, s = np.cos(ang), np.sin(ang)
    out = x.copy()
    ia, ib = (np.arange(E // 2), np.arange(E // 2) + E // 2) if style == "neox" else (np.arange(0, E, 2),
                                                                                     np.arange(1, E, 2))
    out[:, ia] = x[:, ia] * c - x[:, ib] * s
    out[:, ib] = x[:, ib] * c + x[:, ia] * s
    return out


def reference(w):
    """The example's attention, written here without qkv: (weights (L, S), output (L, Ev) or None)."""
    L, S = w.n_queries, w.n_keys
    if w.start == "scores":
        s = np.array(w.scores)
        d_k = float(w.d_k)
    else:
        Q, K = (w.Q, w.K) if w.start == "QK" else (w.X @ w.W_Q, (w.X if w.X_kv is None else w.X_kv) @ w.W_K)
        if w.rope is not None:
            qp = np.arange(L) if w.positions is None else w.positions
            kp = w.kv_positions if w.kv_positions is not None else (qp if not w.is_cross else np.arange(S))
            Q = rope_numpy(Q, qp, w.rope["theta"], w.rope["style"])
            K = rope_numpy(K, kp, w.rope["theta"], w.rope["style"])
        s = Q @ K.T
        d_k = float(w.d_k) if w.d_k is not None else Q.shape[1]
    s = s / math.sqrt(d_k)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    if w.alibi is not None:
        m = ex_slopes(w)[0]
        s = s + m * (j - i)
    if w.softcap is not None:
        s = w.softcap * np.tanh(s / w.softcap)
    allowed = np.ones((L, S), bool)
    if isinstance(w.mask, str):
        allowed &= j <= i
    elif w.mask is not None:
        allowed &= w.mask
    if w.window is not None:
        allowed &= (i - j >= 0) & (i - j < w.window)
    if w.prefix is not None:
        allowed &= (j < w.prefix) | (j <= i)
    if w.documents is not None:
        allowed &= w.documents[:, None] == w.documents[None, :]
    if w.sinks is not None:                     # or-ed with the other mask keys, or with causal when there are none
        masked_otherwise = w.mask is not None or w.window is not None or w.prefix is not None \
            or w.documents is not None
        allowed = (allowed if masked_otherwise else j <= i) | (j < w.sinks)
    s = np.where(allowed, s, -np.inf)
    sink = None if w.sink_logits is None else float(w.sink_logits[0])
    wts = softmax_rows(s, sink)
    V = w.V if w.start != "X" else (w.X if w.X_kv is None else w.X_kv) @ w.W_V
    return wts, (None if V is None else wts @ V)


def ex_slopes(w):
    return qkv.mods.alibi_slopes(w.heads) if w.alibi is True else np.asarray(w.alibi)


def as2d(a):
    a = np.asarray(a)
    return a.reshape(a.shape[-2:])


# ----------------------------------------------------------------------------------------------- every example
@pytest.mark.parametrize("name", VARIANTS)
def test_run_equals_the_formula_written_here(name):
    w = ex.load_example(name)
    assert w.has_variants
    t = ex.run(w)
    wts, out = reference(w)
    np.testing.assert_allclose(as2d(t["weights"].array), wts, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(as2d(t["output"].array), out, rtol=1e-12, atol=1e-15)


def test_the_new_examples_are_listed(capsys):
    names = ex.builtin_names()
    for n in VARIANTS:
        assert n in names
    rc, out, _ = run_cli(capsys, "examples")
    assert rc == 0
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert "RoPE" in line["rope"] and "ALiBi" in line["alibi"] and "softcap 2" in line["softcap"]
    assert "window 2" in line["sliding_window"] and "documents" in line["document"]
    assert "sinks 1" in line["sinks"] and "sink logits" in line["sinks"]


@pytest.mark.parametrize("name", VARIANTS)
def test_trace_has_the_new_steps_in_pipeline_order(name):
    t = ex.run(ex.load_example(name))
    want = {"rope": ["Q_rot", "K_rot"], "alibi": ["biased"], "softcap": ["capped"], "sliding_window": ["masked"],
            "document": ["masked"], "sinks": ["masked"]}[name]
    names = [s.name for s in t if s.op != "input"]          # the computed steps
    for n in want:
        assert n in names
    order = [n for n in qkv.stages.PIPELINE_ORDER if n in names]
    assert [n for n in names if n in order] == order


# ----------------------------------------------------------------------------------------------- RoPE
def test_rope_by_hand():
    t = ex.run(ex.load_example("rope"))
    # θ = 100, width 4: θ_0 = 100^0 = 1, θ_1 = 100^(−2/4) = 0.1; neox pairs (0, 2) and (1, 3).
    # q = [1, 0, 0, 1] at position 1: pair (0, 2) = (1, 0) turns by 1 rad → (cos 1, sin 1) = (0.540302, 0.841471);
    # pair (1, 3) = (0, 1) turns by 0.1 rad → (0·cos − 1·sin 0.1, 1·cos 0.1 + 0) = (−0.099833, 0.995004)
    np.testing.assert_allclose(t["Q_rot"].array[1], [0.540302, -0.099833, 0.841471, 0.995004], atol=5e-7)
    # position 2: (cos 2, sin 2) = (−0.416147, 0.909297); (−sin 0.2, cos 0.2) = (−0.198669, 0.980067)
    np.testing.assert_allclose(t["Q_rot"].array[2], [-0.416147, -0.198669, 0.909297, 0.980067], atol=5e-7)
    np.testing.assert_array_equal(t["Q_rot"].array[0], [1, 0, 0, 1])          # position 0: no turn
    # the same q and k everywhere: scores[i, j] = cos(i − j) + cos(0.1·(i − j)), a function of i − j only
    # scores[吃, 我] = cos 2 + cos 0.2 = −0.416147 + 0.980067 = 0.563920; [吃, 爱] = cos 1 + cos 0.1 = 1.535306
    s = t["scores"].array
    np.testing.assert_allclose(s[2], [0.563920, 1.535306, 2.0], atol=5e-7)
    np.testing.assert_allclose(s, s.T, atol=1e-15)
    assert abs(s[1, 0] - s[2, 1]) < 1e-15


def test_rope_interleaved_and_positions_and_cross(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("tokens: [a, b]\nkv_tokens: [x, y, z]\nQ: [[1, 2, 3, 4], [0, 1, 0, 1]]\n"
                 "K: [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]\nV: [[1], [2], [3]]\n"
                 "rope: {theta: 10000, style: interleaved, positions: [5, 7], kv_positions: [0, 3, 6]}\n")
    w = ex.load_file(f)
    t = ex.run(w)
    # interleaved pairs (0, 1), (2, 3); q = [1, 2, 3, 4] at position 5: θ_0 = 1, θ_1 = 10000^(−1/2) = 0.01
    # pair (0, 1) by 5 rad: (1·cos 5 − 2·sin 5, 2·cos 5 + 1·sin 5) = (0.283662 + 1.917849, 0.567324 − 0.958924)
    c, s = math.cos(5), math.sin(5)
    np.testing.assert_allclose(t["Q_rot"].array[0, :2], [c - 2 * s, 2 * c + s], atol=1e-15)
    np.testing.assert_allclose(t["Q_rot"].array[0, :2], [2.201511, -0.391600], atol=5e-7)
    # Meta's complex form: (x0 + i·x1) · e^{i·pos·θ}
    z = (np.array([1, 3]) + 1j * np.array([2, 4])) * np.exp(1j * 5 * np.array([1, 0.01]))
    np.testing.assert_allclose(t["Q_rot"].array[0], np.stack([z.real, z.imag], -1).ravel(), atol=1e-14)
    np.testing.assert_allclose(t["K_rot"].array, rope_numpy(w.K, [0, 3, 6], 10000, "interleaved"), atol=1e-15)
    wts, out = reference(w)
    np.testing.assert_allclose(t["weights"].array, wts, rtol=1e-12)


def test_alibi_true_takes_the_slopes_from_the_head_count(tmp_path):
    f = tmp_path / "a.yaml"
    eye = "[[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]"
    f.write_text(f"X: [[1, 0, 2, 1], [0, 1, 1, 0], [2, 1, 0, 1]]\nW_Q: {eye}\nW_K: {eye}\nW_V: {eye}\n"
                 "heads: 2\nalibi: true\nmask: causal\n")
    t = ex.run(ex.load_file(f))
    # two heads: m_h = 2^(−8(h+1)/2) = 2^−4 = 0.0625 and 2^−8 = 0.00390625
    np.testing.assert_allclose(t["biased"].params["slopes"], [0.0625, 0.00390625])
    b = t["biased"]
    np.testing.assert_allclose(b.array[0, 0, 2, 0] - b.operands["scaled"][0, 0, 2, 0], 0.0625 * -2)
    np.testing.assert_allclose(b.array[0, 1, 2, 0] - b.operands["scaled"][0, 1, 2, 0], 0.00390625 * -2)
    with pytest.raises(ValueError, match="alibi"):
        ex.run(ex.from_dict({"Q": [[1.0, 0]], "K": [[1.0, 0]], "alibi": [0.5]}), heads=2)


def test_documents_as_ids_and_prefix(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("Q: [[1, 0], [0, 1], [1, 1], [1, 0]]\nK: [[1, 0], [0, 1], [1, 1], [1, 0]]\nV: [[1], [2], [3], [4]]\n"
                 "documents: {ids: [7, 7, 3, 3]}\n")
    t = ex.run(ex.load_file(f))
    # not causal: a query sees its whole document
    np.testing.assert_array_equal(np.isfinite(t["masked"].array), [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1],
                                                                 [0, 0, 1, 1]])
    f.write_text(f.read_text().replace("{ids: [7, 7, 3, 3]}", "{lengths: [2, 2]}"))
    np.testing.assert_array_equal(ex.load_file(f).documents, [0, 0, 1, 1])   # the same packing, by lengths
    np.testing.assert_array_equal(ex.run(ex.load_file(f))["masked"].array, t["masked"].array)
    f.write_text(f.read_text().replace("documents: {lengths: [2, 2]}", "prefix: 2"))
    t = ex.run(ex.load_file(f))
    # prefix 2: keys 0, 1 visible to every query, the rest causal
    np.testing.assert_array_equal(np.isfinite(t["masked"].array), [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0],
                                                                 [1, 1, 1, 1]])
    assert "prefix 2: the first 2 keys are visible to every query, the rest causally" in render(t)


def test_sinks_alone_mean_causal_plus_the_first_keys(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("scores: [[1, 2, 3], [1, 2, 3], [1, 2, 3]]\nd_k: 1\nsinks: 1\n")
    t = ex.run(ex.load_file(f))
    np.testing.assert_array_equal(np.isfinite(t["masked"].array), np.tril(np.ones((3, 3))) > 0)


def test_mask_override_replaces_the_mask_key_and_the_mods_still_apply():
    w = ex.load_example("document")
    t = ex.run(w, mask="none")                    # documents without causal: each document whole
    np.testing.assert_array_equal(np.isfinite(t["masked"].array), w.documents[:, None] == w.documents[None, :])
    np.testing.assert_array_equal(w.mask_matrix("none"), w.documents[:, None] == w.documents[None, :])
    w = ex.load_example("sliding_window")
    t = ex.run(w, mask=np.ones((4, 4), bool))
    np.testing.assert_array_equal(np.isfinite(t["masked"].array), w.mask_matrix())
    assert ex.load_example("causal").mask_matrix() == "causal" and ex.load_example("seed003").mask_matrix() is None


# ----------------------------------------------------------------------------------------------- explanations
def test_explanations_write_the_arithmetic_with_the_recorded_numbers():
    w = ex.load_example("alibi")
    s = render(ex.run(w), tokens=w.tokens)
    assert "biased[吃, 我] = 0.35 + 0.5×(−2) = −0.65" in s
    assert "biased[吃, 爱] = 0.1 + 0.5×(−1) = −0.4" in s and "slopes: m_0 = 0.5" in s
    w = ex.load_example("softcap")
    s = render(ex.run(w), tokens=w.tokens)
    assert "capped[我, 我] = 2.0·tanh(3.0 / 2.0) = 2.0·tanh(1.5) = 2.0×0.90515 = 1.8103" in s   # 2×0.9051 = 1.8102
    assert "capped[吃, 我] = 2.0·tanh(−1.0 / 2.0) = 2.0·tanh(−0.5) = 2.0×(−0.4621) = −0.9242" in s
    w = ex.load_example("rope")
    s = render(ex.run(w), tokens=w.tokens)
    assert "θ_i = 100.0^(−2i/4): θ_0 = 1.0, θ_1 = 0.1" in s
    assert "Q_rot[爱, (0, 2)]: φ = 1 × 1.0 = 1.0 rad, cos φ = 0.5403, sin φ = 0.8415" in s
    assert "= (1.0×0.5403 − 0×0.8415, 0×0.5403 + 1.0×0.8415) = (0.5403, 0.8415)" in s
    assert "K_rot[吃, (1, 3)]: φ = 2 × 0.1 = 0.2 rad, cos φ = 0.9801, sin φ = 0.1987" in s
    w = ex.load_example("sliding_window")
    s = render(ex.run(w), tokens=w.tokens)
    assert "sliding window 2: query i sees keys i−1 … i" in s and "query 吃 sees keys 1–2 (爱, 吃)" in s
    w = ex.load_example("document")
    s = render(ex.run(w), tokens=w.tokens)
    assert "query 吃 (document 1) sees keys 2–4 (我, 爱, 吃)" in s and "allowed where all of these allow it" in s
    assert "document of each position: 0 0 1 1 1" in s
    w = ex.load_example("sinks")
    s = render(ex.run(w), tokens=w.tokens)
    assert "sink: exp(0 − 2.0) = 0.1353" in s
    assert "sum = 1.0 + 0 + 0.3679 + 0.3679 + 0.1353 = 1.8711" in s
    assert "sinks 1: the first 1 keys are visible to every query" in s


def test_explanations_in_chinese():
    for name, terms in (("rope", ["旋转位置编码", "按位置旋转"]), ("alibi", ["线性距离偏置", "斜率"]),
                        ("softcap", ["软上限"]), ("sliding_window", ["滑动窗口 2", "查询 吃 看到键 1–2"]),
                        ("document", ["查询 吃（文档 1）看到键 2–4"]), ("sinks", ["注意力汇"])):
        w = ex.load_example(name)
        s = render(ex.run(w), tokens=w.tokens, lang="zh")
        for term in terms:
            assert term in s, (name, term)


@pytest.mark.parametrize("name", VARIANTS)
def test_explain_query_writes_the_variant_steps(name):
    w = ex.load_example(name)
    t = ex.run(w)
    q = explain_query(t, w.n_queries - 1, tokens=w.tokens)
    want = {"rope": "Q_rot[吃, (0, 2)]: φ = 2 × 1.0 = 2.0 rad", "alibi": "我 = 0.35 + 0.5×(−2) = −0.65",
            "softcap": "我 = 2.0·tanh(−1.0 / 2.0)", "sliding_window": "query 苹果 sees keys 2–3 (吃, 苹果)",
            "document": "query 吃 (document 1) sees keys 2–4", "sinks": "sink: exp(0 − 2.0) = 0.1353"}[name]
    assert want in q, q
    json.loads(explain_query(t, 0, tokens=w.tokens, fmt="json", lang="zh"))


# ----------------------------------------------------------------------------------------------- check
def test_claims_on_the_new_steps():
    for name in ("rope", "alibi", "softcap"):
        r = check(ex.load_example(name))
        assert r.ok and r.summary["correct"] > 0
    r = check(ex.load_example("rope"))
    assert [c.name for c in r.claims][:4] == ["Q_rot"] * 4 and r.claims[0].label == "爱"


def test_planted_slip_in_q_rot_is_the_root_and_scores_carry_it(tmp_path):
    f = tmp_path / "r.yaml"
    text = (Path(ex.__file__).parents[1] / "examples" / "rope.yaml").read_text(encoding="utf-8")
    # 吃's Q_rot written with cos 2 for −cos 2 (a sign slip): [0.4161, …]
    f.write_text(text.replace("吃: [-0.4161, -0.1987, 0.9093, 0.9801]", "吃: [0.4161, -0.1987, 0.9093, 0.9801]")
                 .replace("scores: {吃: [0.5639, 1.5353, 2]}", "scores: {吃: [1.3962, 1.0856, 2.3463]}"))
    r = check(ex.load_file(f))
    s = statuses(r)
    assert s[("Q_rot", 2, 0)] == "wrong" and s[("Q_rot", 2, 1)] == "correct"
    # from the claimed q: 0.4161×k0 … ; k_我 = [1, 0, 0, 1]: 0.4161 + 0.9801 = 1.3962;
    # k_爱 = [0.5403, −0.0998, 0.8415, 0.9950]: 0.2248 + 0.0198 + 0.7652 + 0.9752 = 1.9850 ≠ 1.0856 (wrong);
    # k_吃 = [−0.4161, −0.1987, 0.9093, 0.9801]: −0.1731 + 0.0395 + 0.8268 + 0.9606 = 1.6538 ≠ 2.3463 (wrong)
    assert s[("scores", 2, 0)] == "carried"
    assert s[("scores", 2, 1)] == "wrong" and s[("scores", 2, 2)] == "wrong"
    c = {(c.name, c.row, c.col): c for c in r.claims}
    assert abs(c[("scores", 2, 1)].recomputed - 1.98503) < 5e-5


def test_planted_slips_in_biased_and_capped(tmp_path, capsys):
    f = tmp_path / "a.yaml"
    f.write_text("tokens: [我, 爱, 吃]\nscores: [[1.4, 0, 0], [0.6, 1.0, 0], [0.7, 0.2, 1.2]]\nd_k: 4\n"
                 "V: [[1, 0], [0, 1], [1, 1]]\nmask: causal\nalibi: [0.5]\nsoftcap: 2\n"
                 "claims:\n  scaled: {吃: [0.35, 0.1, 0.6]}\n  biased: {吃: [-0.15, -0.4, 0.6]}\n"
                 "  capped: {吃: [-0.1497, -0.3799, 0.5370]}\n")
    # biased[吃, 我] written −0.15 (0.35 − 0.5: the distance taken as 1, not 2) → wrong; capped[吃, 我] =
    # 2·tanh(−0.15/2) = 2×(−0.074860) = −0.1497 follows from it → carried; the others: 2·tanh(−0.2) = −0.3948
    # (claimed −0.3799: wrong), 2·tanh(0.3) = 0.5827 (claimed 0.5370: wrong)
    r = check(ex.load_file(f))
    s = statuses(r)
    assert s[("biased", 2, 0)] == "wrong" and s[("biased", 2, 1)] == "correct"
    assert s[("capped", 2, 0)] == "carried"
    assert s[("capped", 2, 1)] == "wrong" and s[("capped", 2, 2)] == "wrong"
    rc, out, _ = run_cli(capsys, "check", f, "--format", "json")
    assert rc == 1
    names = [c["name"] for c in json.loads(out)["claims"]]
    assert names == sorted(names, key=["scaled", "biased", "capped"].index)


# ----------------------------------------------------------------------------------------------- bad input
QK3 = "tokens: [a, b, c]\nQ: [[1, 0], [0, 1], [1, 1]]\nK: [[1, 0], [0, 1], [1, 1]]\nV: [[1], [2], [3]]\n"
SC3 = "scores: [[1, 2, 3], [1, 2, 3], [1, 2, 3]]\nd_k: 1\n"
BAD = [
    ("rope_text", QK3 + "rope: fast\n", "rope: expected a mapping"),
    ("rope_theta", QK3 + "rope: {theta: -1}\n", "rope.theta: expected a positive number, found -1"),
    ("rope_theta_text", QK3 + "rope: {theta: big}\n", "rope.theta: expected a number, found 'big'"),
    ("rope_style", QK3 + "rope: {style: sideways}\n", "rope.style: expected one of neox, interleaved"),
    ("rope_key", QK3 + "rope: {thetas: 10}\n", "rope: unknown key 'thetas'"),
    ("rope_odd", QK3.replace("[1, 0], [0, 1], [1, 1]]\nV", "[1, 0, 1], [0, 1, 1], [1, 1, 1]]\nV")
     .replace("Q: [[1, 0], [0, 1], [1, 1]]", "Q: [[1, 0, 1], [0, 1, 1], [1, 1, 1]]") + "rope: {}\n",
     "rope: RoPE rotates pairs of coordinates; expected an even width of Q and K, found 3"),
    ("rope_scores", SC3 + "rope: {theta: 10}\n", "rope: RoPE rotates Q and K; this file starts from scores"),
    ("rope_positions", QK3 + "rope: {positions: [0, 1]}\n", "rope.positions: expected 3 integers"),
    ("rope_negative", QK3 + "rope: {positions: [0, -1, 2]}\n", "rope.positions[1]: expected an integer ≥ 0"),
    ("rope_float_pos", QK3 + "rope: {positions: [0, 1.5, 2]}\n", "rope.positions[1]: expected an integer ≥ 0, "
                                                                  "found the number 1.5"),
    ("rope_kv_self", QK3 + "rope: {kv_positions: [0, 1, 2]}\n", "rope.kv_positions: only with cross-attention"),
    ("alibi_text", QK3 + "alibi: lots\n", "alibi: expected true (slopes from the head count) or a list of 1"),
    ("alibi_count", QK3 + "alibi: [0.5, 0.25]\n", "alibi: expected 1 numbers (one slope per head), found 2"),
    ("alibi_nan", QK3 + "alibi: [.nan]\n", "alibi[0]: expected a finite number"),
    ("softcap_zero", QK3 + "softcap: 0\n", "softcap: expected a positive number, found 0"),
    ("softcap_text", QK3 + "softcap: big\n", "softcap: expected a number, found 'big'"),
    ("window_zero", QK3 + "window: 0\n", "window: expected a positive integer, found the number 0"),
    ("window_float", QK3 + "window: 1.5\n", "window: expected a positive integer, found the number 1.5"),
    ("prefix_negative", QK3 + "prefix: -1\n", "prefix: expected a positive integer, found the number -1"),
    ("sinks_bool", QK3 + "sinks: true\n", "sinks: expected a positive integer, found the boolean true"),
    ("documents_sum", QK3 + "documents: [2, 2]\n", "documents: expected lengths summing to 3 (the sequence), "
                                                   "found 2 + 2 = 4"),
    ("documents_zero", QK3 + "documents: [3, 0]\n", "documents[1]: expected a positive integer, found the number 0"),
    ("documents_ids", QK3 + "documents: {ids: [0, 0]}\n", "documents.ids: expected 3 integers"),
    ("documents_key", QK3 + "documents: {sizes: [3]}\n", "documents: expected a list of lengths, {lengths: [...]} "
                                                         "or {ids: [...]}"),
    ("documents_text", QK3 + "documents: two\n", "documents: expected a list of document lengths summing to 3"),
    ("documents_cross", "Q: [[1, 0]]\nK: [[1, 0], [0, 1]]\ndocuments: [2]\n",
     "documents: packed documents need self-attention"),
    ("sink_logits_count", QK3 + "sink_logits: [0, 1]\n", "sink_logits: expected 1 numbers (one per head), found 2"),
    ("sink_logits_text", QK3 + "sink_logits: [zero]\n", "sink_logits[0]: expected a number, found 'zero'"),
    ("claim_q_rot", QK3 + "claims: {Q_rot: [[1, 0], [0, 1], [1, 1]]}\n",
     "claims.Q_rot: this example does not compute Q_rot (it has no rope:)"),
    ("claim_biased", QK3 + "claims: {biased: {a: [1, 2, 3]}}\n", "claims.biased: this example does not compute "
                                                                 "biased (it has no alibi:)"),
    ("claim_capped", QK3 + "softcap: 5\nclaims: {capped: {a: [1, 2]}}\n", "claims.capped[a]: expected 3 numbers, "
                                                                          "found 2"),
    ("claim_k_rot_label", QK3 + "rope: {}\nclaims: {K_rot: {z: [1, 2]}}\n", "claims.K_rot: row 'z': no such label"),
    ("overflow", "X: [[1e200, 1], [3, 4]]\nW_Q: [[1, 0], [0, 1]]\nW_K: [[1, 0], [0, 1]]\nW_V: [[1, 0], [0, 1]]\n",
     "scores overflowed: scores[0, 0] = inf"),
]


@pytest.mark.parametrize("fname, content, msg", BAD, ids=[b[0] for b in BAD])
def test_bad_variant_input_is_one_line_exit_2(tmp_path, capsys, fname, content, msg):
    f = tmp_path / f"{fname}.yaml"
    f.write_text(content, encoding="utf-8")
    for cmd in ("explain", "check"):
        rc, out, err = run_cli(capsys, cmd, f)
        assert rc == 2 and out == "", (cmd, out)
        assert err.count("\n") == 1 and err.startswith("qkv: error: ") and "Traceback" not in err
        assert msg in err, err
        assert f.name in err


def test_overflow_through_multi_head_attention_is_one_line_too(tmp_path, capsys):
    f = tmp_path / "o.yaml"
    f.write_text("X: [[1e200, 1], [3, 4]]\nW_Q: [[1, 0], [0, 1]]\nW_K: [[1, 0], [0, 1]]\nW_V: [[1, 0], [0, 1]]\n"
                 "heads: 2\n")
    rc, out, err = run_cli(capsys, "explain", f)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(ValueError):
        ex.run(ex.load_file(f))


def test_python_errors_name_the_key():
    with pytest.raises(ex.WorkedExampleError, match="window: expected a positive integer"):
        ex.from_dict({"Q": [[1.0]], "K": [[1.0]], "window": "wide"})
    with pytest.raises(ex.WorkedExampleError, match="rope: RoPE rotates pairs"):
        ex.from_dict({"Q": [[1.0]], "K": [[1.0]], "rope": True})
    w = ex.from_dict({"Q": [[1.0, 0.0]], "K": [[1.0, 0.0]], "rope": True, "sink_logits": 0.5})
    assert w.rope == {"theta": 10000.0, "style": "neox"} and w.sink_logits.tolist() == [0.5]


def test_the_page_gets_the_variants():
    from qkv import viz

    d = viz.from_worked(ex.load_example("rope"))
    assert d["rope"] == {"theta": 100.0, "style": "neox", "positions": None, "kv_positions": None}
    d = viz.from_worked(ex.load_example("sinks"))
    assert d["sink_logits"] == [0.0] and d["mask"] == ex.load_example("sinks").mask_matrix().tolist()
    assert viz.from_worked(ex.load_example("alibi"))["alibi"] == [0.5]
    assert viz.from_worked(ex.load_example("softcap"))["softcap"] == 2.0
    with pytest.raises(ValueError, match="rope"):
        viz.playground_data(scores=[[1.0]], d_k=1, rope={"theta": 10})
    with pytest.raises(ValueError, match="sink_logits"):
        viz.playground_data(scores=[[1.0]], d_k=1, sink_logits=[0, 1])
