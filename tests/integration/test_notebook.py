"""Notebooks: qkv.viz.show and the objects' own _repr_html_ (self-contained, offline), ``import qkv`` staying light,
and examples/tour.ipynb executed by nbclient on a real Jupyter kernel, its HTML outputs rendered in Chromium."""
from __future__ import annotations

import html
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import qkv
from qkv.explain import examples

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOUR = ROOT / "examples" / "tour.ipynb"
X = np.array([[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]])
W_Q = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])


def srcdoc(fragment: str) -> str:
    """The page inside a show() iframe."""
    m = re.fullmatch(r'<iframe srcdoc="([^"]*)" sandbox="allow-scripts" [^>]*></iframe>', fragment, re.S)
    assert m, fragment[:200]
    return html.unescape(m.group(1))


def embedded(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def assert_offline(fragment: str):
    """No address to fetch anything from: no src/href but data:, no URL but the SVG namespace."""
    page = srcdoc(fragment) if fragment.startswith("<iframe") else fragment
    assert re.findall(r'(?:src|href)\s*=\s*"(?!data:)', page) == []
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}
    if fragment.startswith("<iframe"):
        assert "default-src 'none'" in page


# ------------------------------------------------------------------------------------------ import qkv
def test_import_qkv_stays_light_and_qkv_viz_comes_on_first_use():
    code = ("import sys, qkv\n"
            "assert 'qkv.viz' not in sys.modules and 'matplotlib' not in sys.modules, 'imported at import qkv'\n"
            "assert 'torch' not in sys.modules\n"
            "qkv.viz.show\n"
            "assert 'qkv.viz' in sys.modules and 'matplotlib' not in sys.modules, 'qkv.viz pulled in matplotlib'\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qkv.nope  # noqa: B018


# ------------------------------------------------------------------------------------------ show
def test_show_a_trace_is_the_playground():
    with qkv.trace() as t:
        qkv.attention(X, W_Q, W_Q + 0.1, W_Q + 0.2)
    fragment = t._repr_html_()
    assert fragment == qkv.viz.show(t)._repr_html_()
    assert_offline(fragment)
    data = embedded(srcdoc(fragment))
    assert data["playground"]["X"] == X.tolist() and data["playground"]["W_K"] == (W_Q + 0.1).tolist()
    assert data["example"] is None                                      # one head: the playground shows it all
    assert qkv.Trace()._repr_html_() is None                           # nothing to show: the notebook uses repr


def test_show_a_multi_head_trace_and_weights():
    with qkv.trace() as t:
        qkv.MultiHeadAttention(8, 4, seed=0)(np.random.default_rng(0).standard_normal((5, 8)))
    data = embedded(srcdoc(qkv.viz.show(t, tokens=list("abcde"))._repr_html_()))
    ex = data["example"]
    assert data["playground"] is None and ex["heads"] == 4 and ex["tokens"] == list("abcde")
    from qkv.viz import page_maps as page
    got = page.decode_maps(ex["maps"])
    w = t["weights"].array.reshape(4, 5, 5)
    for h in range(4):
        np.testing.assert_array_equal(got[h], page.quantize(w[h]))
    arr = qkv.viz.show(w[:2], name="two heads")
    assert embedded(srcdoc(arr._repr_html_()))["example"]["name"] == "two heads"
    with pytest.raises(ValueError, match="expected 5 labels"):
        qkv.viz.show(t, tokens=["a"])


def test_show_a_worked_example_and_a_check_report_in_both_languages():
    worked = examples.load_example("seed003")
    en, zh = qkv.viz.show(worked), qkv.viz.show(worked, lang="zh")
    assert embedded(en.html)["lang"] == "en" and embedded(zh.html)["lang"] == "zh"
    assert embedded(zh.html)["strings"]["page.reset"] == "重置"
    report = qkv.explain.check(worked)
    frag = qkv.viz.show(report)._repr_html_()
    assert frag.startswith('<div class="qkv-check" lang="en" data-qkv="check" data-ok="false"')
    assert "<script" not in frag and html.escape(report.render(fmt="text")) in frag
    zh_frag = qkv.viz.show(report, lang="zh")._repr_html_()
    assert 'lang="zh"' in zh_frag and html.escape(report.render(lang="zh", fmt="text")) in zh_frag
    assert_offline(frag)
    with pytest.raises(ValueError, match="lang"):
        qkv.viz.show(worked, lang="fr")
    with pytest.raises(TypeError, match="expected a qkv.Trace"):
        qkv.viz.show(object())


def test_shown_save_and_height(tmp_path):
    s = qkv.viz.show(examples.load_example("two_head"), height=400)
    assert 'height: 400px' in s._repr_html_() and repr(s).startswith("Shown(page, ")
    path = s.save(tmp_path / "two_head.html")
    assert pathlib.Path(path).read_text(encoding="utf-8") == s.html


@pytest.mark.model
def test_model_outputs_show_themselves():
    models = pytest.importorskip("qkv.models")
    try:
        bert = models.load_bert()
    except ImportError as exc:
        pytest.skip(f"no model: {exc}")
    out = bert.run(["The cat sat.", "A longer second sentence here."])
    frag = out._repr_html_()
    assert_offline(frag)
    m = embedded(srcdoc(frag))["model"]
    assert m["tokens"] == list(out.tokens[0]) and m["layers"] == 6 and m["heads"] == 12 and not m["decoder"]
    second = embedded(qkv.viz.show(out, index=1).html)["model"]
    assert second["tokens"] == list(out.tokens[1])
    try:
        llama = models.load_llama()
    except ImportError as exc:
        pytest.skip(f"no SmolLM2: {exc}")
    lo = llama.run("The cat sat.")
    m = embedded(srcdoc(lo._repr_html_()))["model"]
    assert m["decoder"] and m["heads"] == 9 and m["kv_heads"] == 3 and m["tokens"] == list(lo.tokens[0])


# ------------------------------------------------------------------------------------------ the tour, executed
_RENDER = r"""
import json, sys
from playwright.sync_api import sync_playwright
results = []
with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"])
    for path in sys.argv[1:]:
        ctx = b.new_context(viewport={"width": 1200, "height": 900})
        errors, requests = [], []
        ctx.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:", "about:"))
                  else (requests.append(r.request.url), r.abort()))
        page = ctx.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto("file://" + path)
        got = {"path": path, "frames": []}
        for frame in page.frames[1:]:
            frame.wait_for_selector("body[data-ready='true']", timeout=60000)
            got["frames"].append({"lang": frame.evaluate("document.documentElement.lang"),
                                  "title": frame.evaluate("document.getElementById('title').textContent"),
                                  "ready_ms": float(frame.evaluate("document.body.dataset.readyMs")),
                                  "canvases": frame.evaluate("document.querySelectorAll('canvas').length"),
                                  "inputs": frame.evaluate("document.querySelectorAll('input').length")})
        got["check"] = page.evaluate("document.querySelectorAll('[data-qkv=check]').length")
        got["errors"], got["requests"] = errors, requests
        results.append(got)
        ctx.close()
    b.close()
print(json.dumps(results, ensure_ascii=False))
"""


def _kernel(tmp_path: pathlib.Path) -> str:
    """A kernel spec for this venv's Python (offline, in a temporary JUPYTER_PATH folder)."""
    folder = tmp_path / "jupyter" / "kernels" / "qkv-venv"
    folder.mkdir(parents=True)
    (folder / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "qkv (venv)", "language": "python"}), encoding="utf-8")
    os.environ["JUPYTER_PATH"] = str(tmp_path / "jupyter") + os.pathsep + os.environ.get("JUPYTER_PATH", "")
    return "qkv-venv"


@pytest.mark.model
@pytest.mark.browser
def test_the_tour_notebook_runs_and_its_pages_render_offline(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    try:
        qkv_models = pytest.importorskip("qkv.models")
        qkv_models.bert.default_model_path()
    except ImportError as exc:
        pytest.skip(f"no model: {exc}")
    if not os.path.exists("/usr/bin/chromium"):
        pytest.fail("Chromium is missing at /usr/bin/chromium (apt-get install chromium)")
    monkeypatch.setenv("JUPYTER_PATH", os.environ.get("JUPYTER_PATH", ""))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    kernel = _kernel(tmp_path)
    nb = nbformat.read(TOUR, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")   # committed without outputs
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name=kernel,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()                                                    # raises CellExecutionError on any error
    saved = tmp_path / "tour.ipynb"
    nbformat.write(nb, saved)                                           # saved, then opened again
    nb = nbformat.read(saved, as_version=4)
    nbformat.validate(nb)
    htmls = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if o.get("output_type") in ("execute_result", "display_data") and "text/html" in o.get("data", {})]
    assert len(htmls) == 6                           # seed, trace, check report, MiniLM, rollout, zh
    files = []
    for n, fragment in enumerate(htmls):
        assert_offline(fragment)
        f = tmp_path / f"output{n}.html"
        f.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{fragment}</body></html>",
                     encoding="utf-8")
        files.append(str(f))
    p = subprocess.run([sys.executable, "-c", _RENDER, *files], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)
    for r in results:
        assert r["errors"] == [] and r["requests"] == [], r
    frames = [r["frames"] for r in results]
    pages = [f for fs in frames for f in fs]
    assert len(pages) == 5 and sum(r["check"] for r in results) == 1           # 5 pages, 1 check report
    assert [f["lang"] for f in pages] == ["en"] * 4 + ["zh"]
    assert pages[0]["inputs"] > 10 and pages[1]["inputs"] > 10          # the playgrounds (worked example, trace)
    assert pages[2]["canvases"] >= 72                                   # MiniLM: a thumbnail per layer × head
    assert pages[3]["title"] == "rollout" and pages[3]["canvases"] >= 2
    assert all(f["ready_ms"] <= 5000 for f in pages)
