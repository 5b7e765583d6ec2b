"""The page's HTML, without a browser: self-contained, no network address, data that cannot break out."""
import base64
import os
import hashlib
import json
import re

import numpy as np
import pytest

from qkv import viz

X = np.array([[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]])
W_Q = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
EVIL = ["</script><script>alert(1)</script>", "<img src=x onerror=alert(1)>", "&amp; \u2028 <!--"]


def page(**kw):
    return viz.render_page({"playground": viz.playground_data(X, W_Q, W_Q + 0.1, W_Q + 0.2, **kw)})


def embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_data_round_trips_exactly():
    html = page(tokens=["我", "爱", "吃"])
    data = embedded(html)["playground"]
    assert data["tokens"] == ["我", "爱", "吃"]
    np.testing.assert_array_equal(data["X"], X)                     # floats survive JSON bit for bit
    np.testing.assert_array_equal(data["W_K"], W_Q + 0.1)
    assert data["heads"] == 1 and data["causal"] is False and data["scaling"] is True


def test_user_text_cannot_close_the_script_tag():
    html = page(tokens=EVIL, title="</title><script>alert(2)</script>")
    assert html.count("</script>") == 2                             # the JSON tag's and the code's, nothing else
    assert html.lower().count("<script") == 2
    assert "<img" not in html and "<!--" not in html
    assert "\u2028" not in html
    data = embedded(html)["playground"]
    assert data["tokens"] == EVIL and data["title"] == "</title><script>alert(2)</script>"
    assert "<title>&lt;/title&gt;&lt;script&gt;alert(2)&lt;/script&gt;</title>" in html


def test_self_contained_no_network_address():
    html = page()
    # No external resource of any kind: no src/href to anything but data:, no url(), no fetch/XHR/imports.
    assert re.findall(r'(?:src|href)\s*=\s*"(?!data:)', html) == []
    assert "url(" not in html and "@import" not in html
    for api in ("fetch(", "XMLHttpRequest", "WebSocket", "import(", "EventSource", "sendBeacon"):
        assert api not in html
    # The only URL in the file is the SVG namespace (an identifier, never requested).
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}


def test_content_security_policy_allows_only_the_pages_script():
    html = page()
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert "default-src 'none'" in csp
    code = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp


def test_every_testid_matrix_is_named_in_the_script():
    js = re.search(r"<script>(.*?)</script>", page(), re.S).group(1)
    for name in ("X", "W_Q", "W_K", "W_V", "Q", "K", "V", "scores", "scaled", "weights", "output"):
        assert f'"{name}"' in js


def test_write_page(tmp_path):
    path = viz.write_page(tmp_path / "a.html", {"playground": viz.playground_data(X, W_Q, W_Q, W_Q)})
    assert open(path, encoding="utf-8").read().startswith("<!DOCTYPE html>")
    with pytest.raises(OSError):
        viz.write_page(tmp_path / "no" / "a.html", {"playground": viz.playground_data(X, W_Q, W_Q, W_Q)})


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens=["a", "b"]), "tokens: expected 3 tokens"),
    (dict(heads=2), "heads: expected a number of heads dividing"),
    (dict(mask=np.ones((2, 3), bool)), r"mask: expected shape \(3, 3\)"),
    (dict(mask=np.full((3, 3), 0.5)), "mask: the page shows a boolean mask"),
    (dict(W_O=np.ones((2, 2))), "W_O: expected 3 rows"),
])
def test_playground_data_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        viz.playground_data(X, W_Q, W_Q, W_Q, **kwargs)


def test_playground_data_shape_errors():
    with pytest.raises(ValueError, match="W_Q: expected 4 rows"):
        viz.playground_data(X, W_Q[:3], W_Q, W_Q)
    with pytest.raises(ValueError, match="W_K: expected 3 columns"):
        viz.playground_data(X, W_Q, W_Q[:, :2], W_Q)
    with pytest.raises(ValueError, match="X: expected finite numbers"):
        viz.playground_data(X * np.inf, W_Q, W_Q, W_Q)
    with pytest.raises(ValueError, match="data: expected a dict"):
        viz.render_page({})


def test_float_mask_of_zero_and_minus_inf_becomes_boolean():
    m = np.where(np.tril(np.ones((3, 3), bool)), 0.0, -np.inf)
    d = viz.playground_data(X, W_Q, W_Q, W_Q, mask=m)
    assert d["mask"] == np.tril(np.ones((3, 3), bool)).tolist()


def test_starting_points_q_k_and_scores():
    q = viz.playground_data(Q=np.eye(3), K=np.ones((4, 3)), d_k=4)
    assert q["start"] == "QK" and q["X"] is None and q["V"] is None and q["d_k"] == 4
    assert q["kv_tokens"] == ["t0", "t1", "t2", "t3"]              # L ≠ S: keys get their own labels
    s = viz.playground_data(scores=[[4.0, 2.0, 0.0]], d_k=4, V=[[10.0], [0.0], [-10.0]])
    assert s["start"] == "scores" and s["scores"] == [[4.0, 2.0, 0.0]] and s["V"] == [[10.0], [0.0], [-10.0]]
    with pytest.raises(ValueError, match="K: expected K with Q"):
        viz.playground_data(Q=np.eye(3))
    with pytest.raises(ValueError, match="d_k: expected the d_k of the given scores"):
        viz.playground_data(scores=np.eye(3))
    with pytest.raises(ValueError, match="expected a starting point"):
        viz.playground_data()
    with pytest.raises(ValueError, match="heads: expected"):
        viz.playground_data(Q=np.eye(4), K=np.eye(4), heads=2)
    assert viz.playground_data(X, W_Q, W_Q, W_Q, mask="causal")["causal"] is True


def test_from_worked_every_builtin_example():
    examples = pytest.importorskip("qkv.explain.examples")
    for name in examples.builtin_names():
        w = examples.load_example(name)
        d = viz.from_worked(w)
        assert d["start"] == w.start and d["heads"] == w.heads and d["title"] == w.title
        assert d["tokens"] == list(w.tokens)
        html = viz.render_page({"playground": d})
        assert embedded(html)["playground"] == json.loads(json.dumps(d))


# ------------------------------------------------------------------------------------------ the page at any size
from qkv.viz import page as vpage   # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow


def _softmax(x, causal=False):
    if causal:
        x = np.where(np.tri(*x.shape[-2:], dtype=bool), x, -np.inf)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_quantize_is_pythons_rounding_to_the_digits_shown():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        w = rng.random(20_000).astype(dtype) ** 3
        k = vpage.quantize(w)
        assert [f"{x / 1000:.3f}" for x in k] == [format(float(x), ".3f") for x in w]
    # float64 values whose ×1000 lands on a tie: the exact binary value decides, as format() does
    near = np.array([0.0005, 0.0015, 0.0025, 0.1235, 0.9995, 0.4445, 1.0, 0.0], np.float64)
    assert [f"{x / 1000:.3f}" for x in vpage.quantize(near)] == [format(float(x), ".3f") for x in near]
    with pytest.raises(ValueError, match="finite"):
        vpage.quantize(np.array([np.nan]))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        vpage.quantize(np.array([1.5]))


@pytest.mark.parametrize("causal", [False, True])
def test_map_code_round_trips_exactly(causal):
    rng = np.random.default_rng(1 + causal)
    shapes = [(1, 1), (1, 7), (9, 9), (40, 40), (13, 30)] if not causal else [(1, 1), (9, 9), (40, 40), (64, 64)]
    maps = [_softmax(rng.standard_normal(s) * rng.uniform(0.5, 6), causal=causal) for s in shapes]
    maps.append(np.eye(shapes[-1][0], shapes[-1][1]))               # weights of exactly 1 and 0
    ms = vpage.MapSet()
    ms.add_group(maps[:2], causal=causal)
    ms.add_group(maps[2:], causal=causal)
    data = ms.to_json()
    assert data["table_of"] == [0, 0] + [1] * (len(maps) - 2) and len(data["tables"]) == 2
    for got, w in zip(vpage.decode_maps(data), maps):
        np.testing.assert_array_equal(got, vpage.quantize(w))
    assert len(data["thumb_shapes"]) == len(maps) and max(max(s) for s in data["thumb_shapes"]) <= vpage.THUMB


def test_map_code_is_compact_and_bounded():
    rng = np.random.default_rng(3)
    T = 256
    logits = rng.standard_normal((4, T, T)) * 1.5
    logits[0, np.arange(1, T), np.arange(T - 1)] += 8                  # a previous-token head
    w = _softmax(logits, causal=True).astype(np.float32)
    ms = vpage.MapSet()
    ms.add_group(list(w), causal=True)
    cells = 4 * T * (T + 1) // 2
    assert ms.size < cells * 0.8          # under a byte per weight, base64 included (noisy heads: the worst case)
    small = vpage.MapSet(budget=10_000, what="a test")
    with pytest.raises(vpage.PageTooLarge, match=r"a test: the page would pass its limit of 30 MB"):
        small.add_group(list(w), causal=True)
    with pytest.raises(vpage.PageTooLarge, match="holds at most 150,000,000"):
        vpage._check_cells(30 * 9, 2048, 2048, True, "a text of 2,048 tokens")
    assert vpage._check_cells(30 * 9, 1024, 1024, True, "x") == 30 * 9 * 1024 * 1025 // 2


def test_worked_data_small_large_and_over_the_limit():
    """worked_data is the value of the page's "example" at any size: the playground (small), the canvas view with
    its notice (large), or the notice alone (too large)."""
    examples = pytest.importorskip("qkv.explain.examples")
    small = viz.worked_data(examples.load_example("seed003"))
    assert small["kind"] == "playground" and small["tokens"] == ["我", "爱", "吃"]
    assert embedded(viz.render_page({"example": small}))["playground"]["tokens"] == ["我", "爱", "吃"]
    rng = np.random.default_rng(4)
    T = 150
    doc = {"title": "long", "tokens": [f"t{i}" for i in range(T)], "X": rng.standard_normal((T, 4)).tolist(),
           "W_Q": rng.standard_normal((4, 4)).tolist(), "W_K": rng.standard_normal((4, 4)).tolist(),
           "W_V": rng.standard_normal((4, 4)).tolist()}
    large = viz.worked_data(examples.from_dict(doc))
    assert large["kind"] == "example" and large["notices"][0]["key"] == "page.playground_too_big"
    got = vpage.decode_maps(large["maps"])[0]
    want = examples.run(examples.from_dict(doc))["weights"].array
    np.testing.assert_array_equal(got, vpage.quantize(want))
    page = embedded(viz.render_page({"example": large}))
    assert page["playground"] is None and page["example"]["T"] == T
    assert [n["key"] for n in page["notices"]] == ["page.playground_too_big"]
    n = vpage.EXAMPLE_MAX_TOKENS + 1
    huge = viz.worked_data(examples.from_dict({"tokens": [f"t{i}" for i in range(n)], "Q": [[1.0]] * n,
                                               "K": [[1.0]] * n}))
    assert huge["kind"] == "notice"
    assert huge["notices"] == [{"key": "page.example_too_big",
                                "args": {"title": huge["notices"][0]["args"]["title"], "L": n, "S": n,
                                         "limit": vpage.EXAMPLE_MAX_TOKENS}}]
    html = viz.render_page({"example": huge})                           # the page says so (in page.js's words)
    assert '"page.example_too_big"' in html and embedded(html)["example"] is None


def test_a_playground_too_large_is_left_out_with_a_notice(monkeypatch):
    rng = np.random.default_rng(5)
    big = viz.playground_data(rng.standard_normal((60, 8)), *(rng.standard_normal((8, 8)) for _ in range(3)))
    data = embedded(viz.render_page({"playground": big}))
    assert data["playground"] is None and data["notices"][0]["key"] == "page.playground_too_big"
    monkeypatch.setattr(vpage, "MAX_PAGE_BYTES", 20_000)
    with pytest.raises(vpage.PageTooLarge, match="over its limit of 0.02 MB"):
        viz.render_page({"playground": viz.playground_data(X, W_Q, W_Q, W_Q)})


def test_write_page_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "a.html"
    viz.write_page(path, {"playground": viz.playground_data(X, W_Q, W_Q, W_Q)})
    before = path.read_bytes()
    real_fdopen = os.fdopen

    class HalfWritten:                                                  # the disk fills up mid-write
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            self.fh.write(text[:100])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: HalfWritten(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError, match="No space"):
        viz.write_page(path, {"playground": viz.playground_data(X, W_Q + 1, W_Q, W_Q)})
    monkeypatch.undo()
    assert path.read_bytes() == before                                  # the old page, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html"]     # no temporary file left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())   # the permissions a plain open() gives


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_view_cli_limits_are_one_line(tmp_path, capsys):
    from qkv.cli import main

    out = tmp_path / "v.html"
    assert main(["view", "--text", "hi", "--model", "gpt2", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "expected a model name (minilm or smollm2), got 'gpt2'" in err and err.count("\n") == 1
    assert main(["view", "--generate", "hi", "--model", "minilm", "-o", str(out)]) == 2
    assert "needs a decoder" in capsys.readouterr().err
    assert main(["view", "--generate", "hi", "--text", "x", "-o", str(out)]) == 2
    assert "not both" in capsys.readouterr().err
    assert not out.exists()
