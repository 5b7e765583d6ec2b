"""``qkv heatmap`` and ``qkv view``: the files they write, and one-line errors with exit code 2."""
import json
import re

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("matplotlib")
examples = pytest.importorskip("qkv.explain.examples")

from qkv.cli import main  # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

X = np.array([[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]])
W_Q = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-", ".svg": b"<?xml"}


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def embedded(path) -> dict:
    html = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', html, re.S).group(1))


def assert_one_line_error(code, err, pattern):
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("qkv"), err
    assert "Traceback" not in err
    assert re.search(pattern, err), err


def test_heatmap_default_is_seed_003(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "heatmap")
    assert code == 0, err
    assert (tmp_path / "attention.png").read_bytes().startswith(SIGNATURES[".png"])
    assert "attention.png" in out


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_heatmap_format_by_suffix(tmp_path, capsys, suffix):
    out = tmp_path / f"w{suffix}"
    code, _, err = run(capsys, "heatmap", "-o", str(out))
    assert code == 0, err
    assert out.read_bytes().startswith(SIGNATURES[suffix])


def test_heatmap_every_builtin_example(tmp_path, capsys):
    for name in examples.builtin_names():
        out = tmp_path / f"{name}.svg"
        code, _, err = run(capsys, "heatmap", "--example", name, "-o", str(out))
        assert code == 0, (name, err)
        assert b"<svg" in out.read_bytes()[:2000]


def test_heatmap_labels_are_the_tokens(tmp_path, capsys):
    out = tmp_path / "w.svg"
    code, _, err = run(capsys, "heatmap", "--tokens", "alpha", "beta", "gamma", "--title", "T", "-o", str(out))
    assert code == 0, err
    svg = out.read_text(encoding="utf-8")
    for token in ("alpha", "beta", "gamma"):
        assert f"<!-- {token} -->" in svg                          # matplotlib names each text in a comment


def test_view_default_and_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "view")
    assert code == 0, err
    data = embedded(tmp_path / "attention.html")["playground"]
    np.testing.assert_array_equal(data["X"], X)                     # seed 003's numbers
    np.testing.assert_allclose(data["W_Q"], W_Q)
    np.testing.assert_allclose(data["W_K"], W_Q + 0.1)
    np.testing.assert_allclose(data["W_V"], W_Q + 0.2)
    assert data["tokens"] == ["我", "爱", "吃"]
    code, out, err = run(capsys, "view", "--tokens", "I", "love", "eating", "-o", "t.html")
    assert code == 0, err
    assert embedded(tmp_path / "t.html")["playground"]["tokens"] == ["I", "love", "eating"]
    code, out, err = run(capsys, "view", "--tokens", "I love eating", "-o", "t2.html")
    assert code == 0, err
    assert embedded(tmp_path / "t2.html")["playground"]["tokens"] == ["I", "love", "eating"]


def test_view_in_chinese(tmp_path, capsys):
    """`qkv view --lang zh` embeds the zh locale's page strings (the page's words come from locales/zh.json)."""
    from qkv import locales
    out = tmp_path / "zh.html"
    code, _, err = run(capsys, "view", "--lang", "zh", "-o", str(out))
    assert code == 0, err
    data = embedded(out)
    assert data["lang"] == "zh" and data["strings"] == locales.strings("zh", "page.")
    assert data["strings"] != locales.strings("en", "page.")
    code, _, err = run(capsys, "view", "--lang", "xx", "-o", str(tmp_path / "xx.html"))
    assert code == 2 and "--lang" in err and not (tmp_path / "xx.html").exists()


def test_view_every_builtin_example(tmp_path, capsys):
    for name in examples.builtin_names():
        out = tmp_path / f"{name}.html"
        code, _, err = run(capsys, "view", "--example", name, "-o", str(out))
        assert code == 0, (name, err)
        worked = examples.load_example(name)
        data = embedded(out)["playground"]
        assert data["start"] == worked.start
        for key in ("X", "X_kv", "W_Q", "W_K", "W_V", "Q", "K", "V", "scores"):
            given = getattr(worked, key)
            if given is None:
                assert data[key] is None
            else:
                np.testing.assert_array_equal(data[key], given)
        assert data["tokens"] == list(worked.tokens)
        assert data["causal"] == (isinstance(worked.mask, str) and worked.mask == "causal")


@pytest.mark.parametrize("command", ["heatmap", "view"])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, command):
    suffix = ".png" if command == "heatmap" else ".html"
    code, _, err = run(capsys, command, "--example", "no-such-example", "-o", str(tmp_path / f"a{suffix}"))
    assert_one_line_error(code, err, r"unknown example 'no-such-example'")
    code, _, err = run(capsys, command, str(tmp_path / "missing.yaml"), "-o", str(tmp_path / f"a{suffix}"))
    assert_one_line_error(code, err, r"cannot read .*missing\.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("this: [is not, a worked example\n", encoding="utf-8")
    code, _, err = run(capsys, command, str(bad), "-o", str(tmp_path / f"a{suffix}"))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    code, _, err = run(capsys, command, "-o", str(tmp_path / "no-such-folder" / f"a{suffix}"))
    assert_one_line_error(code, err, r"cannot write")
    code, _, err = run(capsys, command, "-o", str(tmp_path))
    assert_one_line_error(code, err, r"cannot write|expected a file name")
    code, _, err = run(capsys, command, "-o", str(tmp_path / "a.txt"))
    assert_one_line_error(code, err, r"expected a file name ending in")
    code, _, err = run(capsys, command, "--tokens", "a", "b", "-o", str(tmp_path / f"a{suffix}"))
    assert_one_line_error(code, err, r"--tokens: expected 3 tokens")


def test_heatmap_head_options(tmp_path, capsys):
    code, _, err = run(capsys, "heatmap", "--head", "1", "--all-heads", "-o", str(tmp_path / "a.png"))
    assert_one_line_error(code, err, "either --head H or --all-heads")
    code, _, err = run(capsys, "heatmap", "--head", "3", "-o", str(tmp_path / "a.png"))
    assert_one_line_error(code, err, "--head")
