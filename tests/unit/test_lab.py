"""qkv lab: the seeds' claims by experiment (issue 12), held to theory and thresholds.

- scale: the variance of q·k within 5 % of d_k, of q·k/√d_k within 5 % of 1; the unscaled max weight rising
  towards 1 while the scaled one stays flat; the unscaled score gradient falling by orders of magnitude, the
  scaled one flat; the score gradient from qkv's backward agrees with the chain rule and finite differences;
- mask: −∞ before softmax vs zeroing after (row sums, leak from padding, gradient to padding, fully masked
  rows), −1e9 and −1e4 in float16;
- heads: two heads beat one of the same total width, and take one relation each;
- train: ≥ 95 % held-out accuracy and attention to the antecedent ≥ 0.8, rising from chance; the learned
  W_Q/W_K explained with qkv explain's machinery (它's q matches 树's k); the whole model's gradients (qkv's
  backward for the attention, the chain rule for the rest) against finite differences;
- the command: tables, --json (= the API's data), --plot (atomic; a missing viz extra is one line, exit 2),
  --lang, bad input (one line, exit 2), the installed script.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv import lab
from qkv.cli import main
from qkv.lab import _heads, _mask, _scale, _train, common as _common

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SCALE_KEYS = ["d_k", "score_var", "score_var_scaled", "max_weight", "max_weight_scaled", "entropy",
              "entropy_scaled", "grad_norm", "grad_norm_scaled"]


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def scale_result():
    return lab.scale()


@pytest.fixture(scope="module")
def mask_result():
    return lab.mask()


@pytest.fixture(scope="module")
def heads_result():
    return lab.heads()


@pytest.fixture(scope="module")
def train_result():
    return lab.train()


# ----------------------------------------------------------------------------------------------- scale
def test_scale_variance_is_d_k_and_one(scale_result):
    rows = scale_result["rows"]
    assert [r["d_k"] for r in rows] == [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert all(list(r) == SCALE_KEYS for r in rows)
    for r in rows:
        assert abs(r["score_var"] / r["d_k"] - 1) < 0.05, r
        assert abs(r["score_var_scaled"] - 1) < 0.05, r


def test_scale_softmax_saturates_unscaled_and_stays_flat_scaled(scale_result):
    rows = scale_result["rows"]
    mw = [r["max_weight"] for r in rows]
    assert all(a < b for a, b in zip(mw, mw[1:])) and mw[0] < 0.5 and mw[-1] > 0.95      # rising towards 1
    mws = [r["max_weight_scaled"] for r in rows]
    assert max(mws) / min(mws) < 1.1 and max(mws) < 0.3                                     # flat
    ent = [r["entropy"] for r in rows]
    assert all(a > b for a, b in zip(ent, ent[1:])) and ent[-1] < 0.15
    ents = [r["entropy_scaled"] for r in rows]
    assert max(ents) - min(ents) < 0.05 and min(ents) > 2.0                               # ln 16 = 2.77
    assert scale_result["theory"]["uniform_entropy"] == pytest.approx(math.log(16), rel=1e-5)


def test_scale_gradient_falls_by_orders_of_magnitude_unscaled(scale_result):
    rows = scale_result["rows"]
    g = [r["grad_norm"] for r in rows]
    assert all(a > b for a, b in zip(g, g[1:]))
    assert g[0] / g[-1] > 1e3                                                           # ≥ 3 orders of magnitude
    gs = [r["grad_norm_scaled"] for r in rows]
    assert max(gs) / min(gs) < 1.2 and min(gs) > 0.5                                    # flat
    means = scale_result["grad_norm_mean"]
    assert [m["d_k"] for m in means] == [r["d_k"] for r in rows]
    assert means[0]["grad_norm"] > means[-1]["grad_norm"]


def test_score_gradient_is_qkvs_backward_by_the_chain_rule():
    """∂loss/∂s from flex_attention_backward(query = s, key = I) equals finite differences of qkv's forward,
    and ∂loss/∂q from the real (q, k) backward is scale · ∂loss/∂s · K."""
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((2, 1, 3, 6)), rng.standard_normal((2, 1, 4, 6))
    v, g = rng.standard_normal((2, 1, 4, 5)), rng.standard_normal((2, 1, 3, 5))
    c = 1 / math.sqrt(6)
    s = c * q @ np.swapaxes(k, -1, -2)
    ds = _scale.score_gradient(s, v, g)
    dq, dk, _ = qkv.flex_attention_backward(g, q, k, v, scale=c)
    np.testing.assert_allclose(dq, c * ds @ k, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dk, c * np.swapaxes(ds, -1, -2) @ q, rtol=1e-10, atol=1e-12)
    eye = np.broadcast_to(np.eye(4), (2, 1, 4, 4))

    def loss(s_):
        return float(np.sum(g * qkv.scaled_dot_product_attention(s_, eye, v, scale=1.0)))

    h = 1e-6
    for idx in [(0, 0, 0, 0), (1, 0, 2, 3), (0, 0, 1, 2)]:
        e = np.zeros_like(s)
        e[idx] = h
        assert ds[idx] == pytest.approx((loss(s + e) - loss(s - e)) / (2 * h), rel=1e-6, abs=1e-9)


# ----------------------------------------------------------------------------------------------- mask
def test_mask_inf_before_softmax_is_exact(mask_result):
    m = {r["method"]: r for r in mask_result["methods"]}
    assert list(m) == ["-inf", "zero_after", "-1e9", "-1e4_fp16"]
    inf = m["-inf"]
    assert inf["row_sum_min"] == pytest.approx(1, abs=1e-12) and inf["row_sum_max"] == pytest.approx(1, abs=1e-12)
    assert inf["pad_weight"] == 0 and inf["leak"] == 0 and inf["pad_grad"] == 0 and inf["diff_vs_inf"] == 0
    assert inf["fully_masked_weight_sum"] == 0 and inf["fully_masked_output_norm"] == 0     # qkv: zero rows


def test_mask_zeroing_after_softmax_breaks_rows_and_leaks(mask_result):
    z = {r["method"]: r for r in mask_result["methods"]}["zero_after"]
    assert z["row_sum_min"] < 0.5 and z["row_sum_max"] == pytest.approx(1)               # padded sentence's rows
    assert z["leak"] > 1e-2                                                              # padding leaks in
    assert z["pad_grad"] > 1e-3                                                          # and gets a gradient
    assert z["diff_vs_inf"] > 0.1


def test_mask_large_finite_negatives(mask_result):
    m = {r["method"]: r for r in mask_result["methods"]}
    e9, e4 = m["-1e9"], m["-1e4_fp16"]
    assert e9["diff_vs_inf"] < 1e-6 and e9["leak"] == 0 and e9["pad_grad"] == 0
    assert e4["diff_vs_inf"] < 5e-3 and e4["leak"] == 0 and e4["pad_grad"] == 0          # float16's rounding
    # a fully masked row: the constant cancels (or float32's rounding erases the scores): it attends to all keys
    assert e9["fully_masked_weight_sum"] == pytest.approx(1, abs=1e-6) and e9["fully_masked_uniform"]
    assert e4["fully_masked_weight_sum"] == pytest.approx(1, abs=2e-3) and not e4["fully_masked_uniform"]
    assert e9["fully_masked_output_norm"] > 0.1 and e4["fully_masked_output_norm"] > 0.1
    assert mask_result["float16_of_-1e9"] == "-inf" and mask_result["textbook_softmax_fully_masked"] == "nan"
    w = np.array(mask_result["weights"]["-inf"])                                         # (B, T, T)
    assert w.shape == (2, 5, 5) and np.all(w[1, 2:] == 0) and np.all(w[1, :2, 2:] == 0)


def test_zeroing_padding_after_softmax_is_attention_over_zeroed_values():
    """The identity the zero_after gradient rests on: for the real query rows, softmax over every key with the
    padding's weights zeroed equals attention without a mask over V whose padding rows are 0."""
    x, w, _, real, mask = _mask._setup(np.random.default_rng(0))
    (o, _), _ = _mask._apply("zero_after", x, w, mask, real)
    q, k, v = _mask._project(x, w)
    o2 = qkv.scaled_dot_product_attention(q, k, np.where(real[:, None, :, None], v, 0.0))
    rows = real[:, None, :, None]
    np.testing.assert_allclose(np.where(rows, o, 0), np.where(rows, o2, 0), atol=1e-12)


# ----------------------------------------------------------------------------------------------- heads
def test_two_heads_beat_one(heads_result):
    one, two = heads_result["models"]
    assert (one["heads"], two["heads"]) == (1, 2)
    assert one["heads"] * one["head_width"] == two["heads"] * two["head_width"] == heads_result["settings"]["width"]
    assert two["accuracy"] >= 0.95 and two["accuracy"] > one["accuracy"] + 0.2
    assert min(two["accuracies"]) > max(one["accuracies"])                               # in every run
    kinds = sorted(a["kind"] for a in two["attention"])
    assert kinds == ["matching bracket", "previous token"]                                # one relation each
    for a in two["attention"]:
        assert max(a["previous_token"], a["matching_bracket"]) > 0.9
    assert len(one["example_weights"]) == 1 and len(two["example_weights"]) == 2


def test_heads_task():
    rng = np.random.default_rng(0)
    for _ in range(20):
        toks, m, y = _heads.sequence(rng)
        assert len(toks) == 8 and m < 6
        kinds = [tok[0] for tok in toks]
        assert kinds.count(kinds[-1]) == 2 and kinds[m] == kinds[-1]                     # exactly one match
        assert y == 4 * "abcd".index(toks[-2][1]) + "abcd".index(toks[m][1])
    assert _heads.head_kind(0.9, 0.05) == "previous token" and _heads.head_kind(0.1, 0.8) == "matching bracket"
    assert _heads.head_kind(0.4, 0.4) == "both" and _heads.head_kind(0.1, 0.1) == "other"


# ----------------------------------------------------------------------------------------------- train
def test_train_learns_to_find_the_antecedent(train_result):
    r = train_result
    assert {"steps", "initial_loss", "final_loss", "accuracy", "attention_to_antecedent"} <= set(r)
    assert r["accuracy"] >= 0.95                                                         # held out
    assert r["attention_to_antecedent"] >= 0.8                                           # held out
    assert abs(r["steps"][0]["attention"] - r["chance_attention"]) < 0.05               # from chance …
    assert r["steps"][0]["step"] == 0 and r["steps"][-1]["step"] == r["settings"]["steps"]
    assert r["final_loss"] < r["initial_loss"] / 10
    assert r["initial_loss"] == pytest.approx(math.log(len(_train.NOUNS)), rel=0.15)   # chance level: ln 23
    assert all(set(s) == {"step", "loss", "accuracy", "attention"} for s in r["steps"])


def test_train_explains_its_learned_q_matching_the_trees_k(train_result):
    from qkv.explain import examples as ex

    e = train_result["explain"]
    toks = e["tokens"]
    assert "".join(toks) == "银行旁边有一棵树，它很高" and e["query"] == "它"
    assert e["antecedent"] == "树" and e["top"] == "树"
    i, j = toks.index("树"), toks.index("银行")
    assert e["weights"][i] > 0.8 and e["scaled_scores"][i] > e["scaled_scores"][j]
    assert e["scaled_scores"][i] == pytest.approx(float(np.dot(e["q"], e["k_antecedent"])) / math.sqrt(e["d_k"]),
                                                  rel=1e-4)
    # the worked example is a file qkv explain reads, and gives the same numbers
    w = ex.from_dict(json.loads(json.dumps(train_result["worked_example"])))
    tr = ex.run(w)
    np.testing.assert_allclose(tr["weights"].array[toks.index("它")], e["weights"], rtol=1e-4, atol=1e-9)
    text = lab.explain_train(train_result)
    assert "Query 它" in text and "q · k_树 = " in text and "q · k_银行 = " in text
    assert "查询 它" in lab.explain_train(train_result, lang="zh") or "它" in lab.explain_train(train_result, "zh")


def test_the_language():
    assert _train.agrees("它", "树") and _train.agrees("它", "银行") and not _train.agrees("它", "老师")
    assert _train.agrees("他", "老师") and _train.agrees("她", "老师") and not _train.agrees("他", "妈妈")
    assert _train.antecedent(_train.SENTENCE.split()) == 5                               # 树, not 银行
    assert _train.antecedent("妈妈 看见 了 猫 ， 她 很 高".split()) == 0
    rng = np.random.default_rng(0)
    for _ in range(200):
        s = _train.sentence(rng)
        p = next(i for i, w in enumerate(s) if w in _train.PRONOUNS)
        a = _train.antecedent(s)
        assert _train.agrees(s[p], s[a])
        assert not any(_train.agrees(s[p], w) for w in s[a + 1:p] if w in _train.NOUNS)
        nouns = [w for w in s if w in _train.NOUNS]
        assert len(nouns) == len(set(nouns))
    # no measure word names its noun: each is shared by two nouns or more
    cls = list(_train.CLASSIFIER.values())
    assert all(cls.count(c) >= 2 for c in cls)


def test_the_whole_models_gradients_match_finite_differences():
    """qkv's backward for the attention and the chain rule for the embeddings, projections, readout and
    cross-entropy, against central differences of the loss (float64, two heads, padded sentences)."""
    rng = np.random.default_rng(0)
    model = _common.TinyAttention(11, 6, 5, d_model=4, heads=2, d_head=3, d_value=2, rng=rng)
    ids = rng.integers(1, 11, size=(4, 6))
    lengths = np.array([6, 4, 5, 3])
    ids[np.arange(6)[None, :] >= lengths[:, None]] = 0
    qpos = np.array([5, 2, 4, 1])
    y = np.array([0, 3, 1, 4])
    loss, grads, _, _ = model.loss_and_grads(ids, qpos, lengths, y)
    assert loss == pytest.approx(model.loss(ids, qpos, lengths, y), rel=1e-12)
    assert set(grads) == set(_common.TinyAttention.NAMES)
    h = 1e-6
    for name, p in model.params.items():
        num = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            old = p[idx]
            p[idx] = old + h
            up = model.loss(ids, qpos, lengths, y)
            p[idx] = old - h
            down = model.loss(ids, qpos, lengths, y)
            p[idx] = old
            num[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(grads[name], num, rtol=1e-5, atol=1e-8, err_msg=name)
    # padding gets no gradient: the padded positions' rows of Pos only collect from real tokens
    assert np.all(grads["Emb"][0] == 0)


def test_deterministic_for_a_seed():
    a, b, c = lab.train(steps=5, batch=8, held_out=20), lab.train(steps=5, batch=8, held_out=20), \
        lab.train(steps=5, batch=8, held_out=20, seed=1)
    assert a == b and a != c
    assert lab.mask(seed=3) == lab.mask(seed=3) != lab.mask(seed=4)
    assert lab.scale(samples=64, d_ks=(4, 16)) == lab.scale(samples=64, d_ks=(4, 16))


def test_bad_arguments():
    with pytest.raises(ValueError, match="seed"):
        lab.mask(seed=-1)
    with pytest.raises(ValueError, match="steps"):
        lab.train(steps=0)
    with pytest.raises(ValueError, match="width"):
        lab.heads(width=7)
    with pytest.raises(ValueError, match="name: expected one of scale, mask, heads, train"):
        lab.paragraph("nope", {})
    with pytest.raises(ValueError, match=r"batch, held_out: needs about [\d,.]+ GiB"):
        lab.train(steps=1, held_out=10**11)              # before a list of 10¹¹ sentences is begun


# ----------------------------------------------------------------------------------------------- paragraphs
def test_paragraphs_in_both_languages(scale_result, mask_result, heads_result, train_result):
    results = {"scale": scale_result, "mask": mask_result, "heads": heads_result, "train": train_result}
    for name, r in results.items():
        en, zh = lab.paragraph(name, r, "en"), lab.paragraph(name, r, "zh")
        assert en and zh and en != zh and re.search(r"[\u4e00-\u9fff]{4}", zh), name
        title, heads, rows = lab.table(name, r)
        assert title.startswith(f"qkv lab {name}") and all(len(row) == len(heads) for row in rows)
    assert "4.4 orders of magnitude" in lab.paragraph("scale", scale_result) or "orders of magnitude" in \
        lab.paragraph("scale", scale_result)
    assert "它's q has come to match 树's k" in lab.paragraph("train", train_result)
    assert "它 的 q 已经学会匹配 树 的 k" in lab.paragraph("train", train_result, "zh")


def test_every_lab_key_exists_in_both_locales():
    en = json.loads((ROOT / "src/qkv/locales/en.json").read_text(encoding="utf-8"))
    zh = json.loads((ROOT / "src/qkv/locales/zh.json").read_text(encoding="utf-8"))
    text = "\n".join(p.read_text(encoding="utf-8") for p in
                     list((ROOT / "src/qkv/tools/lab").glob("*.py")) + [ROOT / "src/qkv/cli/lab_cmd.py",
                                                                  ROOT / "src/qkv/viz/lab_plots.py"])
    asked = set(re.findall(r"""["'](lab\.[A-Za-z_0-9]+)["']""", text))
    keys = {k for k in en if k.startswith("lab.")}
    assert len(asked) > 40 and asked == keys and keys == {k for k in zh if k.startswith("lab.")}


# ----------------------------------------------------------------------------------------------- the command
def test_cli_json_is_the_apis_data(capsys):
    rc, out, err = run_cli(capsys, "lab", "train", "--steps", "15", "--json")
    assert rc == 0 and err == ""
    assert json.loads(out) == json.loads(json.dumps(lab.train(steps=15), ensure_ascii=False))
    rc, out, _ = run_cli(capsys, "lab", "scale", "--samples", "64", "--json")
    assert rc == 0 and json.loads(out) == json.loads(json.dumps(lab.scale(samples=64)))
    rc, out, _ = run_cli(capsys, "lab", "mask", "--json", "--seed", "2")
    assert rc == 0 and json.loads(out) == json.loads(json.dumps(lab.mask(seed=2)))
    rc, out, _ = run_cli(capsys, "lab", "heads", "--steps", "5", "--runs", "1", "--json")
    data = json.loads(out)
    assert rc == 0 and [m["heads"] for m in data["models"]] == [1, 2] and data["settings"]["runs"] == 1


def test_cli_tables_and_paragraphs(capsys):
    rc, out, _ = run_cli(capsys, "lab", "mask")
    assert rc == 0 and out.startswith("qkv lab mask") and "−∞ before softmax" in out and "Zeroing" in out
    rc, out, _ = run_cli(capsys, "lab", "mask", "--lang", "zh")
    assert rc == 0 and "softmax 前置 −∞" in out and "泄漏" in out
    rc, out, _ = run_cli(capsys, "lab", "train", "--steps", "15", "--explain")
    assert rc == 0 and "attention to antecedent" in out and "Query 它" in out and "q · k_树 = " in out
    rc, out, _ = run_cli(capsys, "lab", "scale", "--samples", "64")
    assert rc == 0 and "1024" in out and "orders of magnitude" in out


def test_cli_plots(capsys, tmp_path):
    for name, extra in (("scale", ["--samples", "64"]), ("mask", []), ("heads", ["--steps", "3", "--runs", "1"]),
                        ("train", ["--steps", "3"])):
        path = tmp_path / f"{name}.png"
        rc, out, err = run_cli(capsys, "lab", name, "--plot", path, *extra)
        assert rc == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", err
        assert f"wrote {path}" in out
    rc, out, err = run_cli(capsys, "lab", "mask", "--plot", tmp_path / "m.svg", "--json", "--lang", "zh")
    assert rc == 0 and json.loads(out) and "已写入" in err and (tmp_path / "m.svg").read_text().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.png", "m.svg", "mask.png", "scale.png",
                                                          "train.png"]            # no temporary file left


def test_a_failed_plot_leaves_no_file(tmp_path, mask_result, monkeypatch):
    from matplotlib.figure import Figure

    def boom(self, *a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", boom)
    with pytest.raises(OSError):
        qkv.viz.plot_lab("mask", mask_result, tmp_path / "m.png")
    assert list(tmp_path.iterdir()) == []


def test_plot_lab_names_the_experiments(tmp_path, mask_result):
    # the lab returns data and qkv.viz draws it (qkv.lab.plot, its deprecated name, is gone: lab is below viz)
    pytest.importorskip("matplotlib")
    assert not hasattr(lab, "plot")
    assert qkv.viz.plot_lab("mask", mask_result, tmp_path / "m.svg") == str(tmp_path / "m.svg")
    assert (tmp_path / "m.svg").read_text().startswith("<?xml")
    with pytest.raises(ValueError, match="expected one of scale, mask, heads, train"):
        qkv.viz.plot_lab("nope", mask_result, tmp_path / "x.png")


def test_cli_bad_input(capsys, tmp_path, monkeypatch):
    for args, what in ((["--plot", tmp_path / "x.gif"], "--plot: expected a file name ending in .png, .svg, .pdf"),
                       (["--plot", tmp_path / "no" / "x.png"], "does not exist"),
                       (["--plot", tmp_path], "it is a folder"),
                       (["--lang", "fr"], "'fr' is not one of"),
                       (["--seed", "-1"], "--seed")):
        rc, out, err = run_cli(capsys, "lab", "mask", *args)
        assert rc == 2 and out == "" and what in err and err.count("\n") == 1, (args, err)
    rc, _, err = run_cli(capsys, "lab", "train", "--steps", "0")
    assert rc == 2 and "--steps" in err and err.count("\n") == 1
    rc, _, err = run_cli(capsys, "lab", "nope")
    assert rc == 2 and "nope" in err and err.count("\n") == 1
    # the viz extra missing: one line naming it, before any work
    monkeypatch.setattr(_common, "matplotlib_available", lambda: False)
    monkeypatch.setattr(_train, "run", lambda **kw: pytest.fail("ran without the viz extra"))
    rc, out, err = run_cli(capsys, "lab", "train", "--plot", tmp_path / "t.png")
    assert rc == 2 and out == "" and err == "qkv: error: --plot needs the viz extra (matplotlib): pip install " \
                                           "'qkv[viz]'\n"
    rc, _, err = run_cli(capsys, "lab", "train", "--plot", tmp_path / "t.png", "--lang", "zh")
    assert rc == 2 and "viz 扩展" in err


def test_the_installed_script():
    exe = Path(sys.executable).parent / "qkv"
    if not exe.exists():
        pytest.skip("the qkv script is not installed next to this Python")
    p = subprocess.run([str(exe), "lab", "mask"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert p.returncode == 0 and p.stdout.startswith("qkv lab mask") and "\x1b[" not in p.stdout   # plain, piped
    p = subprocess.run([str(exe), "lab", "heads", "--runs", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_the_docs_page():
    text = (ROOT / "docs" / "lab.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- BEGIN section:lab -->(.*?)<!-- END section:lab -->", text, re.S)
    assert m and "](docs/lab/scale.png)" in (ROOT / "README.md").read_text(encoding="utf-8")
    section = m.group(1)
    assert section.lstrip().startswith("# Why it works: `qkv lab`")
    for name in lab.NAMES:
        png = ROOT / "docs" / "lab" / f"{name}.png"
        assert f"](lab/{name}.png)" in section and png.read_bytes()[:4] == b"\x89PNG"
        assert png.stat().st_size < 300_000
        assert f"qkv lab {name}" in section
    assert "`--lang zh`:" in section and "它 的 q 已经学会匹配 树 的 k" in section
