"""Issue 41's long-input view in Chromium, offline, English and Chinese: `qkv view --hf DIR --text-file FILE
--rows …` on a tiny Llama over 3,000 tokens. Every number read back from the page — the summary table, the
pooled map's cells under the pointer, each exact row's strongest keys — equals Python's (qkv.hf.record with
summaries and rows, the path the page's numbers came from; tests/integration/test_hf_long.py holds that path to eager's full
weights)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qkv.hf  # noqa: E402
from qkv.hf._summary import Summaries  # noqa: E402
from qkv.viz.page_long import encode  # noqa: E402
from test_browser_page import Opened  # noqa: E402
from test_browser_scale import hover_cell, shown  # noqa: E402
from test_hf_long import SMALL, WORDS, _tokenizer, text_of  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.torch]
TOKENS = 3000
ROWS = [0, 1500, -1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama (hidden 64, 2 layers, 4 heads), queries and keys scaled up so that rows have peaks."""
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("tiny-llama-long-browser")
    torch.manual_seed(1)
    m = LlamaForCausalLM(LlamaConfig(**dict(SMALL, vocab_size=len(WORDS))))
    with torch.no_grad():                                         # sharp rows: a row's peak weight ≈ 0.6
        for n, p in m.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(30.0 if n.endswith("q_proj.weight") else 10.0)
    m.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


def python_side(folder, text):
    """What Python computes for the page: tokens, summaries and the exact rows (qkv.hf.record)."""
    m = qkv.hf.load(folder)
    ids, tokens = encode(m, text)
    with qkv.hf.record(m.model, rows=ROWS, summaries=Summaries(tokens=tokens)) as rec, torch.no_grad():
        m.model(input_ids=torch.from_numpy(ids[None]))
    return m, tokens, rec


def top_keys(w: np.ndarray, n: int = 5) -> str:
    """A row's n strongest keys as the page writes them (data-keys): "j:0.xxx", ties by position."""
    k = np.rint(w.astype(np.float64) * 1000).astype(np.int64)
    order = sorted(range(len(k)), key=lambda j: (-k[j], j))[:n]
    return " ".join(f"{j}:{shown(w[j])}" for j in order)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_long_view_shows_pythons_summaries_pooled_cells_and_exact_rows(browser, folder, tmp_path, lang):
    from qkv.cli import main
    src = tmp_path / f"long-{lang}.txt"
    src.write_text(text_of(TOKENS, zh=lang == "zh", seed=3), encoding="utf-8")
    page = tmp_path / "long.html"
    args = ["view", "--hf", str(folder), "--text-file", str(src), "--rows", ",".join(map(str, ROWS)), "-o", str(page),
            "--lang", lang]
    assert main(args) == 0
    m, tokens, rec = python_side(folder, src.read_text(encoding="utf-8"))
    assert len(tokens) == TOKENS
    o = Opened(browser, page)
    try:
        p = o.page
        assert folder.name in p.title() and src.name in p.title()
        assert p.get_by_test_id("long-view").is_visible()
        heading = p.locator("#long h2").text_content()
        assert ("每一层" in heading) == (lang == "zh") and "3000" in heading
        for layer in range(2):
            s = rec.summaries[layer]
            for h in range(4):
                for field, values in (("entropy", s.entropy), ("distance", s.distance), ("sink", s.sink)):
                    cell = p.get_by_test_id(f"long-{layer}-{h}-{field}").text_content()
                    assert cell == f"{round(float(values[0, h]), 4):.4f}", (layer, h, field)
                assert p.get_by_test_id(f"long-{layer}-{h}-kind").get_attribute("data-kind") == s.kind[0, h]
        for layer, h in ((0, 0), (1, 2)):
            p.get_by_test_id(f"long-thumb-{layer}-{h}").click()
            assert p.get_by_test_id(f"long-thumb-{layer}-{h}").get_attribute("aria-pressed") == "true"
            s = rec.summaries[layer]
            pooled = s.pooled[0, h]
            a = 100
            cells = [(a, a), (a, 0), (255, 255), (255, 0), (a, int(np.argmax(pooled[a])))]
            for i, j in cells:                                    # the diagonal, the sink column, the row's peak
                assert hover_cell(o, "long-map", i, j) == shown(pooled[i, j]), (layer, h, i, j)
            assert pooled[a].max() > 0.3                           # (a peak: the shown digits are not all 0)
            hover = p.get_by_test_id("long-map-hover").text_content()
            e0, e1 = int(s.row_edges[a]), int(s.row_edges[a + 1]) - 1
            assert f"{e0}\u2013{e1}" in hover
            W = rec.weights[layer][0, h]                                  # (3, S)
            for r in range(3):
                top = p.get_by_test_id(f"long-top-{r}")
                assert top.get_attribute("data-keys") == top_keys(W[r]), (layer, h, r)
        o.screenshot(f"long-{lang}")
        ready = float(p.get_attribute("body", "data-ready-ms"))
        paints = p.evaluate("performance.getEntriesByType('paint').map(e => e.name)")
        assert "first-contentful-paint" in paints and ready < 2000, ready
        o.check_clean()
    finally:
        o.context.close()


def test_a_page_without_rows_says_how_to_ask_for_them(browser, folder, tmp_path):
    from qkv.cli import main
    src = tmp_path / "short.txt"
    src.write_text(text_of(400, seed=4), encoding="utf-8")
    page = tmp_path / "norows.html"
    assert main(["view", "--hf", str(folder), "--text-file", str(src), "-o", str(page)]) == 0
    o = Opened(browser, page)
    try:
        note = o.page.get_by_test_id("long-no-rows").text_content()
        assert "--rows 0,100,-1" in note and "qkv.hf.record(model, rows=[…])" in note
        o.page.get_by_test_id("long-row-1-3").focus()                       # a table row picks its head
        o.page.keyboard.press("Enter")
        assert o.page.get_by_test_id("long-thumb-1-3").get_attribute("aria-pressed") == "true"
        assert o.page.get_by_test_id("long-row-1-3").get_attribute("aria-pressed") == "true"
        assert o.page.get_by_test_id("long-thumb-0-0").get_attribute("aria-pressed") == "false"
        assert o.page.get_by_test_id("long-selected").text_content().startswith("layer 1, head 3")
        o.check_clean()
    finally:
        o.context.close()
