"""qkv.explain: worked examples run through the real path, and the rendering of a Trace (explain_query too).

References: the seeds' true values checked by hand in tests/unit/test_seeds.py (repeated here where used), torch's
nn.MultiheadAttention for the two-head example, and the trace itself — every number the explanation shows
must be the recorded one (the renderer never recomputes).
"""
import io
from pathlib import Path
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import gemm
from qkv.cli import main
from qkv.explain import examples as ex
from qkv.explain import explain_query, render
from qkv.explain.doc import fmt, print_rich
from qkv.explain.render import build_doc

X = np.array([[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]])
W_Q = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
W_K, W_V = W_Q + 0.1, W_Q + 0.2
NAMES = ex.builtin_names()


def labels(w):
    return (list(w.tokens) if w.tokens_given else None, list(w.kv_tokens) if w.kv_tokens_given else None)


# ----------------------------------------------------------------------------------------------- examples
def test_builtin_examples_are_listed_with_the_default_first():
    assert NAMES[0] == "seed003"
    for name in ("seed000", "seed002", "causal", "padding", "cross", "two_head", "rope", "alibi", "softcap",
                 "sliding_window", "document", "sinks"):
        assert name in NAMES


def test_seed003_example_holds_the_seed_numbers():
    w = ex.load_example("seed003")
    np.testing.assert_array_equal(w.X, X)
    np.testing.assert_array_equal(w.W_Q, W_Q)
    np.testing.assert_allclose(w.W_K, W_K, atol=1e-15)
    np.testing.assert_allclose(w.W_V, W_V, atol=1e-15)
    assert w.tokens == ["我", "爱", "吃"] and w.tokens_given and w.heads == 1 and w.mask is None
    assert [x.text for x in w.claims["output"][2]] == ["1.0170", "1.1970", "1.3770"]   # text as written
    assert [float(x) for x in w.claims["Q"][1]] == [0.05, 0.23, 0.41]                  # as the seed prints


@pytest.mark.parametrize("name", NAMES)
def test_run_equals_the_core_functions(name):
    """The trace of run() is the computation of qkv.attention / SDPA / MultiHeadAttention, value for value."""
    w = ex.load_example(name)
    if w.has_variants:
        pytest.skip("RoPE/ALiBi/softcap/mask-mod/sink examples: tests/unit/test_explain_variants.py holds them to a "
                    "formula written there, to torch and to transformers")
    t = ex.run(w)
    if w.heads > 1:
        m = qkv.MultiHeadAttention(w.X.shape[1], w.heads, bias=False, dtype=np.float64)
        m.load(W_Q=w.W_Q, W_K=w.W_K, W_V=w.W_V, W_O=w.W_O)
        out, wts = m(w.X, need_weights=True, average_attn_weights=False)
        np.testing.assert_array_equal(t["final_output"].array[0], out)
        np.testing.assert_array_equal(t["weights"].array[0], wts)
        assert t["Q_heads"].shape == (1, w.heads, 3, w.X.shape[1] // w.heads)    # (batch, heads, seq, d_k)
        return
    mask = w.mask if isinstance(w.mask, np.ndarray) else None
    causal = isinstance(w.mask, str)
    if w.start == "X":
        out, wts = qkv.attention(w.X, w.W_Q, w.W_K, w.W_V, x_kv=w.X_kv, attn_mask=mask, is_causal=causal)
        np.testing.assert_array_equal(t["Q"].array, gemm.matmul(w.X, w.W_Q))   # the provider's product
    elif w.start == "QK":
        scores = w.Q @ w.K.T
        np.testing.assert_array_equal(t["scores"].array, scores)
        e = np.exp(scores / math.sqrt(float(w.d_k or w.Q.shape[1])))
        wts = e / e.sum(-1, keepdims=True)
        out = None
    else:
        s = w.scores / math.sqrt(float(w.d_k))
        e = np.exp(s - s.max(-1, keepdims=True))
        wts = e / e.sum(-1, keepdims=True)
        out = wts @ w.V
    np.testing.assert_allclose(t["weights"].array, wts, rtol=1e-12, atol=1e-15)
    if out is not None:
        np.testing.assert_allclose(t["output"].array, out, rtol=1e-12, atol=1e-15)


def test_run_seed003_true_values_hand_checked():
    t = ex.run(ex.load_example("seed003"))
    # 吃 attends [0.0299, 0.0071, 0.9630]; its new vector is [1.8733, 2.0818, 2.2903] (tests/unit/test_seeds.py)
    np.testing.assert_allclose(t["weights"].array[2], [0.029888, 0.007125, 0.962987], atol=5e-7)
    np.testing.assert_allclose(t["output"].array[2], [1.873274, 2.081808, 2.290341], atol=5e-6)


def test_run_seed000_and_seed002_true_values():
    t = ex.run(ex.load_example("seed000"))
    assert t.names() == ["Q", "K", "scores", "scaled", "weights"]       # no V in the seed: ends at the weights
    np.testing.assert_allclose(t["weights"].array, [[0.0900, 0.2447, 0.6652], [0.1065, 0.1065, 0.7870],
                                                    [0.0420, 0.1142, 0.8438]], atol=5e-5)
    assert t["scores"].array[0, 0] == 0.0                                 # [1,0,1,0]·[0,1,0,1]
    t = ex.run(ex.load_example("seed002"))
    np.testing.assert_allclose(t["scaled"].array, [[2, 1, 0]])
    np.testing.assert_allclose(t["weights"].array, [[0.6652, 0.2447, 0.0900]], atol=5e-5)
    assert abs(t["output"].array[0, 0] - 5.7521) < 5e-5                   # 0.6652×10 − 0.0900×10


def test_run_overrides_heads_and_mask():
    w = ex.load_example("seed003")
    t = ex.run(w, mask="causal")
    assert t["masked"].array[0, 1] == -np.inf and t["weights"].array[0, 0] == 1.0
    t = ex.run(ex.load_example("causal"), mask="none")
    assert "masked" not in t
    m = np.array([[True, True, False]] * 3)
    t = ex.run(w, mask=m)
    np.testing.assert_array_equal(t["weights"].array[:, 2], 0.0)
    t = ex.run(ex.load_example("two_head"), heads=4)
    assert t["Q_heads"].shape == (1, 4, 3, 1)
    with pytest.raises(ValueError, match="heads"):
        ex.run(w, heads=2)                    # 3 columns cannot be split into 2 heads
    with pytest.raises(ValueError, match="heads"):
        ex.run(ex.load_example("two_head"), heads=3)
    with pytest.raises(ValueError, match="mask"):
        ex.run(w, mask="sideways")
    with pytest.raises(TypeError, match="worked"):
        ex.run({"X": X})


def test_heads_on_a_non_square_projection_equal_single_head_attention_per_column():
    """seed 003's 4×3 projections split into 3 heads of width 1: head h is qkv.attention on column h."""
    w = ex.load_example("seed003")
    t = ex.run(w, heads=3)
    assert t["Q_heads"].shape == (1, 3, 3, 1) and t.names()[-1] == "concat"
    for h in range(3):
        out, wts = qkv.attention(X, W_Q[:, h:h + 1], W_K[:, h:h + 1], W_V[:, h:h + 1])
        np.testing.assert_allclose(t["concat"].array[0, :, h:h + 1], out, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(t["weights"].array[0, h], wts, rtol=1e-12, atol=1e-15)
    q = explain_query(t, 2, head=2, tokens=w.tokens)
    assert "no W_O" in q
    t = ex.run(w, heads=3, mask="causal")
    assert t["weights"].array[0, 1, 0, 2] == 0.0


def test_load_example_unknown_name():
    with pytest.raises(ex.WorkedExampleError, match="seed003"):
        ex.load_example("nope")
    assert issubclass(ex.WorkedExampleError, ValueError)


# ----------------------------------------------------------------------------------------------- render
def test_seed003_text_has_the_textbook_arithmetic():
    w = ex.load_example("seed003")
    s = render(ex.run(w), tokens=w.tokens)
    assert "Q[我, 0] = 1.2×0.1 + 0.8×0.4 + (−0.5)×0.7 + 0.3×1.0 = 0.39" in s      # the line
    assert "Q[爱, 0] = 0.5×0.1 + 1.3×0.4 + 0.2×0.7 + (−0.7)×1.0 = 0.01" in s      # the seed's slip, corrected
    assert "scores[吃, 我] = 1.5×0.57 + 1.71×0.75 + 1.92×0.93 = 3.9231" in s
    # issue 11: 9.9378 / 1.7321 = 5.73743 would not round to 5.7376: one more decimal of √3 makes it add up
    assert "scaled[吃, 吃] = 9.9378 / 1.73205 = 5.7376" in s
    assert "exp(2.265 − 5.7376) = 0.031" in s and "sum = 0.031 + 0.0074 + 1.0 = 1.0384" in s
    assert "吃: 1.0 / 1.0384 = 0.963" in s
    assert "output[吃, 0] = 0.0299×0.75 + 0.0071×0.27 + 0.963×1.92 = 1.8733" in s
    for shape in ("(3, 4) · (4, 3) → (3, 3)", "(3, 3) · (3, 3)ᵀ → (3, 3)"):
        assert shape in s
    assert "\x1b[" not in s                                                      # plain text, no colour codes


def test_chinese_uses_the_seeds_terms():
    w = ex.load_example("seed003")
    s = render(ex.run(w), tokens=w.tokens, lang="zh")
    for term in ("词向量", "查询", "键", "值", "注意力分数", "缩放", "注意力权重", "加权求和", "行乘列求和", "步骤1"):
        assert term in s, term
    s = render(ex.run(ex.load_example("two_head")), lang="zh")
    for term in ("拆分成多个头", "拼接所有头", "W_O", "头 1"):
        assert term in s, term


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("fmt_name", ["text", "markdown", "json"])
def test_every_example_explains_in_every_language_and_format(name, lang, fmt_name):
    w = ex.load_example(name)
    tok, kv = labels(w)
    t = ex.run(w)
    s = render(t, lang=lang, fmt=fmt_name, tokens=tok, kv_tokens=kv)
    assert s.strip()
    if fmt_name == "json":
        doc = json.loads(s)
        assert doc["lang"] == lang and [sec["step"] for sec in doc["sections"]] == t.names()
    elif fmt_name == "markdown":
        assert s.startswith("# ") and "\n## " in s and "|---|" in s
    rows = w.n_queries
    heads = t["weights"].array.shape[-3] if t["weights"].array.ndim > 2 else 1
    for r in range(rows):
        for h in range(heads):
            q = explain_query(t, r, head=h, lang=lang, fmt=fmt_name, tokens=tok, kv_tokens=kv)
            if fmt_name == "json":
                json.loads(q)


def _tables(doc_json):
    for sec in doc_json["sections"]:
        for item in sec["items"]:
            if item["type"] == "table":
                yield sec["step"], item


@pytest.mark.parametrize("name", NAMES)
def test_json_tables_are_the_recorded_arrays(name):
    """Every result table in the JSON is the stage's own array (−∞ as null), not a recomputation."""
    w = ex.load_example(name)
    t = ex.run(w)
    doc = json.loads(render(t, fmt="json"))
    seen = set()
    for step, tb in _tables(doc):
        if not tb["name"].startswith(step):
            continue                                                  # W_Q, mask, ... shown inside a step
        arr = t[step].array
        sl = re.search(r"\[(.*)\]$", tb["name"])
        idx = ()
        if sl:
            nums = [int(n) for n in re.findall(r"\d+", sl.group(1))]
            idx = tuple(nums) if len(nums) == arr.ndim - 2 else (0,) * (arr.ndim - 2 - len(nums)) + tuple(nums)
        elif arr.ndim > 2:
            idx = (0,) * (arr.ndim - 2)
        want = np.where(np.isinf(arr[idx]), np.nan, arr[idx])
        got = np.array([[np.nan if v is None else v for v in row] for row in tb["values"]], dtype=float)
        np.testing.assert_array_equal(got, want)
        seen.add(step)
    assert seen == set(t.names())


def test_renderer_shows_the_recorded_values_not_a_recomputation():
    """A trace whose softmax step was tampered with renders the tampered numbers: nothing is recomputed."""
    t = ex.run(ex.load_example("seed003"))
    step = t["weights"]
    step.array = step.array.copy()
    step.array[2] = [0.111, 0.222, 0.667]
    s = render(t, tokens=["我", "爱", "吃"])
    assert "吃: 1.0 / 1.0384 ≈ 0.667" in s          # shown as recorded; it does not add up, so ≈
    assert "0.0299×0.75" in s                   # the output step recorded the real weights as its operand
    q = explain_query(t, 2)
    assert "1.0 / 1.0384 ≈ 0.667" in q


def _check_products(text, precision):
    """Each written-out 'lhs = a×b + … = v' adds up (to the shown precision)."""
    n = 0
    for line in text.splitlines():
        m = re.search(r"= ((?:\(?[−\d.e]+\)?×\(?[−\d.e]+\)? \+ )*\(?[−\d.e]+\)?×\(?[−\d.e]+\)?) = ([−\d.e]+)$",
                      line.strip())
        if not m:
            continue
        terms = re.findall(r"\(?([−\d.e]+)\)?×\(?([−\d.e]+)\)?", m.group(1))
        val = float(m.group(2).replace("−", "-"))
        total = sum(float(a.replace("−", "-")) * float(b.replace("−", "-")) for a, b in terms)
        slack = 10.0 ** -precision * (1 + sum(abs(float(a.replace("−", "-"))) + abs(float(b.replace("−", "-")))
                                          for a, b in terms))
        assert abs(total - val) <= slack, line
        n += 1
    return n


@settings(max_examples=25)
@given(L=st.integers(1, 4), S=st.integers(1, 4), D=st.integers(1, 4), E=st.integers(1, 3),
       seed=st.integers(0, 10_000), causal=st.booleans())
def test_written_out_arithmetic_adds_up(L, S, D, E, seed, causal):
    rng = np.random.default_rng(seed)
    x, xkv = np.round(rng.uniform(-2, 2, (L, D)), 2), np.round(rng.uniform(-2, 2, (S, D)), 2)
    wq, wk, wv = (np.round(rng.uniform(-1, 1, (D, E)), 2) for _ in range(3))
    t = qkv.Trace()
    qkv.attention(x, wq, wk, wv, x_kv=xkv, is_causal=causal, trace=t)
    s = render(t, precision=8)
    assert _check_products(s, 8) >= L * E          # at least Q's elements were written out
    q = explain_query(t, L - 1, precision=8)
    assert _check_products(q, 8) >= 1


def test_large_inputs_switch_to_shapes_and_summaries():
    m = qkv.MultiHeadAttention(48, 8, seed=0)
    x = np.random.default_rng(0).standard_normal((1, 30, 48)).astype(np.float32)
    t = qkv.Trace()
    m(x, key_mask=np.array([[True] * 26 + [False] * 4]), trace=t)
    s = render(t)
    # issue 11: tables with elided middles — the first and last rows and columns, "…" between
    assert "the first 3 and last 3 of 30 rows" in s and "one element written out" in s and "other 7 are computed" in s
    assert len(s.splitlines()) < 600
    zh = render(t, lang="zh")
    assert "共 30 行，显示前 3 行和后 3 行" in zh


def test_explain_query_on_a_bert_like_trace():
    """Batched multi-head trace (1, H, T, E), long sequence: the largest weights written out, the rest summed."""
    H, T, E = 12, 40, 8
    m = qkv.MultiHeadAttention(H * E, H, seed=1)
    x = np.random.default_rng(3).standard_normal((1, T, H * E)).astype(np.float32)
    t = qkv.Trace()
    m(x, trace=t)
    tokens = [f"w{i}" for i in range(T)]
    doc = json.loads(explain_query(t, 5, head=7, fmt="json", tokens=tokens))
    w = t["weights"].array[0, 7, 5]
    top = sorted(np.argsort(-w, kind="stable")[:8].tolist())
    wt = next(tb for _, tb in _tables(doc) if tb["name"] == "weights")
    assert wt["cols"] == [tokens[j] for j in top]
    np.testing.assert_array_equal(np.array(wt["values"][0]), w[top].astype(float))
    out = next(tb for _, tb in _tables(doc) if tb["name"] == "output")
    np.testing.assert_array_equal(np.array(out["values"][0]), t["output"].array[0, 7, 5].astype(float))
    text = explain_query(t, 5, head=7, tokens=tokens)
    assert "(head 7)" in text and "32 keys have total weight" in text
    assert f"total weight {fmt(w[[j for j in range(T) if j not in top]].sum())}" in text
    assert "concatenated with the other heads" in text


def test_explain_query_small_lines():
    w = ex.load_example("seed003")
    q = explain_query(ex.run(w), 2, tokens=w.tokens)
    assert "q · k_我 = 1.5×0.57 + 1.71×0.75 + 1.92×0.93 = 3.9231" in q
    assert "我: 3.9231 / 1.73205 = 2.265" in q             # / 1.7321 gives 2.26494: not 2.265
    # 0.0299×1.11 + 0.0071×0.53 + 0.963×2.34 = 2.290372 would round to 2.2904: the weights get the digits it needs
    assert "output[吃, 2] = 0.029888×1.11 + 0.007125×0.53 + 0.962987×2.34 = 2.2903" in q


def test_explain_query_on_sdpa_heads_and_masks():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 4, 2)) for _ in range(3))        # (H, L, E): SDPA called directly
    t = qkv.Trace()
    qkv.scaled_dot_product_attention(q, k, v, is_causal=True, trace=t)
    s = explain_query(t, 1, head=2)
    assert "exp(−∞) = 0" in s and "(head 2)" in s
    with pytest.raises(ValueError, match="batch"):
        explain_query(t, 1, head=0, batch=1)
    with pytest.raises(ValueError, match="head"):
        explain_query(t, 1, head=3)


def test_bad_arguments():
    t = ex.run(ex.load_example("seed003"))
    with pytest.raises(TypeError, match="trace"):
        render("not a trace")
    with pytest.raises(ValueError, match="trace"):
        render(qkv.Trace())
    with pytest.raises(ValueError, match="lang"):
        render(t, lang="fr")
    with pytest.raises(ValueError, match="fmt"):
        render(t, fmt="html")
    with pytest.raises(ValueError, match="precision"):
        render(t, precision=-1)
    with pytest.raises(ValueError, match="tokens"):
        render(t, tokens=["a", "b"])
    with pytest.raises(TypeError, match="tokens"):
        render(t, tokens="我爱吃")
    with pytest.raises(ValueError, match="row"):
        explain_query(t, 3)
    with pytest.raises(TypeError, match="row"):
        explain_query(t, "吃")
    with pytest.raises(ValueError, match="head"):
        explain_query(t, 0, head=1)


def test_number_format():
    assert fmt(0.39000000000000007) == "0.39" and fmt(1.0) == "1.0" and fmt(-0.5) == "−0.5"
    assert fmt(-np.inf) == "−∞" and fmt(0.0) == "0" and fmt(2.5e-7) == "2.5e−7"
    assert fmt(0.123456, 2) == "0.12"


def test_rich_output_has_tables_and_colour():
    from rich.console import Console

    w = ex.load_example("causal")
    buf = io.StringIO()
    print_rich(build_doc(ex.run(w), tokens=w.tokens), 4, Console(file=buf, force_terminal=True, width=120))
    out = buf.getvalue()
    assert "\x1b[" in out and "0.39" in out and "−∞" in out


# ----------------------------------------------------------------------------------------------- CLI
def run_cli(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_explain_default_is_seed003(capsys):
    rc, out, err = run_cli(capsys, "explain")
    assert rc == 0 and err == ""
    assert out.startswith("Seed 003") and "1.2×0.1 + 0.8×0.4 + (−0.5)×0.7 + 0.3×1.0 = 0.39" in out
    assert "\x1b[" not in out


@pytest.mark.parametrize("name", NAMES)
def test_cli_explain_every_example(capsys, name):
    for args in (["--lang", "zh"], ["--format", "markdown"], ["--format", "json", "--precision", "2"]):
        rc, out, err = run_cli(capsys, "explain", "--example", name, *args)
        assert rc == 0 and err == "", err
        if "json" in args:
            assert json.loads(out)["sections"]


def test_cli_explain_options(capsys):
    rc, out, _ = run_cli(capsys, "explain", "--mask", "causal")
    assert rc == 0 and "−∞" in out and "Mask" in out
    rc, out, _ = run_cli(capsys, "explain", "-e", "two_head", "--heads", "4")
    assert rc == 0 and "(1, 4, 3, 1)" in out
    rc, out, _ = run_cli(capsys, "explain", "--mask", "padding:2", "--query", "吃")
    assert rc == 0 and out.startswith("Query 吃") and "exp(−∞) = 0" in out
    rc, out, _ = run_cli(capsys, "explain", "--mask", "window:1", "--precision", "2")
    assert rc == 0 and "1.0 / 1.0 = 1.0" in out
    rc, out, _ = run_cli(capsys, "explain", "-e", "two_head", "--query", "1", "--head", "1", "--lang", "zh")
    assert rc == 0 and "头 1" in out
    rc, out, _ = run_cli(capsys, "explain", "tests/data/check/correct.json")
    assert rc == 0 and "5.7521" in out


@pytest.mark.parametrize("args, msg", [
    (["explain", "-e", "nope"], "unknown example 'nope'"),
    (["explain", "--mask", "diagonal"], "--mask"),
    (["explain", "--mask", "padding:9"], "padding:9"),
    (["explain", "--heads", "2"], "divisible by 2"),
    (["explain", "-e", "seed000", "--heads", "2"], "starts from X"),
    (["explain", "--query", "猫"], "--query"),
    (["explain", "--query", "0", "--head", "3"], "--head"),
    (["explain", "--lang", "fr"], "--lang"),
    (["explain", "no/such/file.yaml"], "no such file"),
    (["explain", "-e", "seed003", "tests/data/check/correct.yaml"], "not both"),
])
def test_cli_explain_bad_input_is_one_line_exit_2(capsys, args, msg):
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err


def test_cli_examples_lists_every_example(capsys):
    rc, out, _ = run_cli(capsys, "examples")
    assert rc == 0
    for name in NAMES:
        assert re.search(rf"^{name}\s", out, re.M)
    assert "(default)" in out.splitlines()[0]
    rc, out, _ = run_cli(capsys, "examples", "--format", "json")
    assert [e["name"] for e in json.loads(out)] == NAMES


def test_readme_explain_section_runs(capsys):
    """The Python block of the README's `explain` section runs as written."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "explain.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- BEGIN section:explain -->(.*?)<!-- END section:explain -->", readme, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    for code in blocks:
        ns = {}
        exec(compile(code, "docs/explain.md", "exec"), ns)
    assert "(head 7)" in ns["text"]
    out = capsys.readouterr().out
    assert "步骤1" in out and "q · k_我 = 1.5×0.57 + 1.71×0.75 + 1.92×0.93 = 3.9231" in out
    for cmd in re.findall(r"^qkv (\S.*?)\s+#", section, re.M):      # the shell examples parse and run
        args = [a for a in cmd.split() if a not in ("my_example.yaml",)]
        if "check" in args and len(args) == 1:
            continue
        rc = main(args)
        capsys.readouterr()
        assert rc in (0, 1), cmd


def test_markdown_escapes_labels():
    w = ex.load_example("padding")
    md = render(ex.run(w), fmt="markdown", tokens=w.tokens)
    assert "| &lt;pad&gt; |" in md and "<pad>" not in md.split("```")[0]
    assert "W\\_Q" in md


def test_extreme_precisions(capsys):
    rc, out, _ = run_cli(capsys, "explain", "--precision", "0")
    assert rc == 0 and "Q[我, 0] = 1×0 + 1×0 + 0×1 + 0×1 = 0" in out
    rc, out, _ = run_cli(capsys, "explain", "--precision", "12")
    assert rc == 0 and "= 0.39\n" in out                     # 0.39000000000000007 at 12 decimals is 0.39
    assert fmt(2.5e-7, 2) == "2.5e−7" and fmt(0.3, 0) == "0" and fmt(-0.4, 0) == "0"
