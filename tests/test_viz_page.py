"""The page's HTML, without a browser: self-contained, no network address, data that cannot break out."""
import base64
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


def test_readme_viz_section_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- BEGIN section:viz -->(.*?)<!-- END section:viz -->", readme, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "seed003.png").read_bytes().startswith(b"\x89PNG")
    assert b"<svg" in (tmp_path / "heads.svg").read_bytes()[:1000]
    assert (tmp_path / "attention.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


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
