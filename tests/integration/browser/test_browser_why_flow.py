"""Attention flow and the "Why ÷ √d_k" section in Chromium: the flow map is drawn beside the rollout and its
hover shows the exact flow qkv.viz.attention_flow computed (3 decimals); over the size limit the page says so
with the limit; the d_k slider, moved with the keyboard, shows every row of qkv.lab.scale exactly and the bars
the sampled row's weights; the zh page has no English left in either."""
from __future__ import annotations

import re

import numpy as np
import pytest

from qkv import lab, viz
from qkv.locales import strings
from qkv.viz import page as vpage
from test_browser_scale import assert_hover_exact, open_file, synthetic_layers

pytestmark = pytest.mark.browser

#: Names and terms the zh page keeps as they are (code, commands, the seeds' own q·k / key / query; the tokens).
KEPT = {"qkv", "lab", "scale", "seed", "samples", "viz", "attention_flow", "attentions", "queries", "networkx",
        "pip", "install", "Abnar", "Zuidema", "rollout", "query", "key", "softmax", "nat", "d_k"}


def english_words(text: str) -> list[str]:
    return [w for w in re.findall(r"[A-Za-z][A-Za-z_]{2,}", text) if w not in KEPT]


def model_view(layers, tokens) -> dict:
    """The model view of causal layers with tokens: its head kinds, rollout and flow as model_data makes them."""
    L, H, T = len(layers), layers[0].shape[0], layers[0].shape[-1]
    data = vpage._layers_data(layers, L, H, T, True, what="synthetic", tokens=tokens)
    data.update({"kind": "model", "name": "synthetic", "text": "a synthetic text", "tokens": tokens,
                 "decoder": True, "kv_heads": H})
    return data


@pytest.fixture(scope="module")
def why():
    return viz.why_data(seed=0, samples=512)


def pixels(o, testid: str, points) -> list[list[int]]:
    """The colours at CSS pixels [(x, y), …] of a canvas (one readback: more make Chromium warn)."""
    return o.page.evaluate(
        """([id, points]) => { const c = document.querySelector(`[data-testid="${id}"]`);
             const d = window.devicePixelRatio || 1, img = c.getContext("2d").getImageData(0, 0, c.width, c.height);
             return points.map(([x, y]) => { const p = 4 * (Math.round(y * d) * c.width + Math.round(x * d));
                                             return Array.from(img.data.slice(p, p + 4)); }); }""",
        [testid, points])


def test_the_flow_map_is_drawn_beside_the_rollout_and_exact_on_hover(browser, tmp_path):
    T, L, H = 11, 3, 4
    layers = synthetic_layers(T, L, H, seed=4)
    tokens = [f"t{i}" for i in range(T)]
    F = viz.attention_flow(layers)
    path = tmp_path / "flow.html"
    viz.write_page(path, {"model": model_view(layers, tokens)})
    o = open_file(browser, path)
    try:
        assert o.page.get_by_test_id("flow-title").text_content() == "Attention flow through the layers"
        assert "qkv.viz.attention_flow" in o.page.get_by_test_id("flow-view").text_content()
        assert o.page.get_by_test_id("flow-missing").count() == 0
        r, f = o.page.get_by_test_id("rollout-view").bounding_box(), o.page.get_by_test_id("flow-view").bounding_box()
        assert f["x"] > r["x"] + r["width"] - 1 and abs(f["y"] - r["y"]) < 5             # side by side
        cells = [(i, j) for i in range(T) for j in range(T) if j <= i or (i + j) % 4 == 0]
        assert_hover_exact(o, "flow-map", F, cells, causal=True)
        hover = o.page.get_by_test_id("flow-map-hover").text_content()
        assert "flow" in hover and "t10" in hover
        # the picture: the cell with the most flow is darker than the one with the least (sampled off its number)
        ml, mt, pw, ph = (float(x) for x in o.page.get_by_test_id("flow-map-canvas").get_attribute("data-plot").split())
        at = lambda i, j: (ml + (j + 0.12) * pw / T, mt + (i + 0.2) * ph / T)         # noqa: E731
        strong, weak = pixels(o, "flow-map-canvas", [at(*np.unravel_index(np.argmax(F), F.shape)),
                                                     at(*np.unravel_index(np.argmin(np.where(np.tri(T, dtype=bool), F, 2)),
                                                                          F.shape))])
        assert sum(strong[:3]) < sum(weak[:3]) - 100, (strong, weak)
        o.check_clean()
    finally:
        o.context.close()


def test_over_the_limit_the_page_says_so_with_the_limit(browser, tmp_path):
    T, L, H = 40, 2, 2
    layers = synthetic_layers(T, L, H, seed=5)
    path = tmp_path / "noflow.html"
    viz.write_page(path, {"model": model_view(layers, [f"t{i}" for i in range(T)])})
    o = open_file(browser, path)
    try:
        note = o.page.get_by_test_id("flow-missing").text_content()
        limit = vpage.flow_limit(L)
        assert f"up to {limit} tokens through {L} layers" in note and f"this one has {T}" in note
        assert o.page.get_by_test_id("flow-map").count() == 0
        assert o.page.get_by_test_id("rollout-map-canvas").count() == 1
        o.check_clean()
    finally:
        o.context.close()


def test_the_d_k_slider_shows_qkv_lab_scale_exactly(browser, tmp_path, why):
    rows = lab.scale(seed=0, samples=512)["rows"]
    path = tmp_path / "why.html"
    viz.write_page(path, {"playground": viz.from_worked(_seed003()), "why": why})
    o = open_file(browser, path)
    try:
        p = o.page
        assert p.get_by_test_id("why-paragraph").text_content() == lab.paragraph("scale", why["scale"], "en")
        slider = p.get_by_test_id("why-dk")
        assert p.get_by_test_id("why-dk-value").text_content() == "d_k = 64"           # where it starts
        slider.focus()
        p.keyboard.press("Home")
        keys = [k for k in rows[0] if k != "d_k"]
        for n, row in enumerate(rows):
            if n:
                p.keyboard.press("ArrowRight")                                         # the user moves it
            assert p.get_by_test_id("why-dk-value").text_content() == f"d_k = {row['d_k']}"
            shown = p.eval_on_selector_all("#why td[data-testid]", """els => Object.fromEntries(
                els.map(e => [e.dataset.testid.slice(4), e.textContent]))""")
            assert {k: float(shown[k]) for k in keys} == {k: row[k] for k in keys}, row["d_k"]
            assert f"= d_k = {row['d_k']}," in p.get_by_test_id("why-theory").text_content()
            assert p.get_by_test_id("why-curves").get_attribute("data-dk") == str(row["d_k"])
            ex = why["examples"][n]
            assert int(p.get_by_test_id("why-bars-hover").get_attribute("data-j")) == int(np.argmax(ex["weights"]))
        # the bars of d_k = 1024: hover each key, its weights without and with ÷ √d_k, as Python computed them
        bars = p.get_by_test_id("why-bars")
        bl, bt, bw, bh = (float(x) for x in bars.get_attribute("data-plot").split())
        box = bars.bounding_box()
        ex = why["examples"][-1]
        for j in range(len(ex["weights"])):
            p.mouse.move(box["x"] + bl + (j + 0.5) * bw / len(ex["weights"]), box["y"] + bt + bh / 2)
            h = p.get_by_test_id("why-bars-hover")
            assert int(h.get_attribute("data-j")) == j
            assert float(h.get_attribute("data-w")) == ex["weights"][j]
            assert float(h.get_attribute("data-ws")) == ex["weights_scaled"][j]
            assert h.text_content().startswith(f"key {j}: q·k = ")
        p.keyboard.press("End")                                                        # the slider still has focus
        o.check_clean()
    finally:
        o.context.close()


def _seed003():
    from qkv.explain import examples
    return examples.load_example("seed003")


def test_the_zh_page_has_no_english_left_in_why_and_flow(browser, tmp_path, why):
    T, L, H = 8, 2, 2
    layers = synthetic_layers(T, L, H, seed=6)
    path = tmp_path / "zh.html"
    viz.write_page(path, {"playground": viz.from_worked(_seed003()), "why": why,
                          "model": model_view(layers, [f"词{i}" for i in range(T)])}, lang="zh")
    o = open_file(browser, path)
    try:
        p = o.page
        zh = strings("zh", "page.")
        assert p.get_by_test_id("flow-title").text_content() == zh["page.flow_title"]
        assert p.locator("#why > h2").text_content() == zh["page.why_title"]
        assert p.get_by_test_id("why-paragraph").text_content() == lab.paragraph("scale", why["scale"], "zh")
        text = p.eval_on_selector("#why", "e => e.innerText") + p.get_by_test_id("flow-view").inner_text()
        labels = p.eval_on_selector_all("#why [aria-label], #why canvas", "els => els.map(e => e.getAttribute('aria-label'))")
        assert english_words(text + " ".join(x for x in labels if x)) == []
        assert p.get_by_test_id("why-table").inner_text().count("不缩放") == 1
        p.get_by_test_id("why-bars").hover()
        assert "权重" in p.get_by_test_id("why-bars-hover").text_content()
        o.check_clean()
    finally:
        o.context.close()
