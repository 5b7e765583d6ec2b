"""Issue 41 in Chromium, offline, English and Chinese: the generation view of transformers models (Llama, Gemma2
with a sliding window, Qwen2), the comparison of two checkpoints, and the page that opens on what was asked
(its title, the view first, the playground folded one click away). Every number read back from the page is
compared with Python's: the rows of qkv.hf's forward pass, qkv.hf.compare's table and both models' weights."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import qkv.hf  # noqa: E402
from qkv.hf.generation_rows import generate, sequence_attentions  # noqa: E402
from test_browser_page import Opened  # noqa: E402
from test_browser_scale import hover_cell, shown  # noqa: E402
from test_viz_hf import save_decoder  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.torch]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf41-browser")
    out = {name: save_decoder(root / f"tiny-{name}", name) for name in ("llama", "gemma2", "qwen2")}
    out["tuned"] = save_decoder(root / "tiny-llama-tuned", "llama", perturb_layer=1)
    return out


def cli_page(tmp_path, *args) -> pathlib.Path:
    from qkv.cli import main
    path = tmp_path / "p.html"
    assert main(["view", *[str(a) for a in args], "-o", str(path)]) == 0
    return path


def order(o: Opened) -> list[str]:
    """The ids of main's visible sections and the folded part, in the page's order."""
    return o.page.eval_on_selector_all("main > section:not([hidden]), main > details",
                                       "els => els.map(e => e.id)")


def check_folded(o: Opened, title: str, first: str, playground: str | None):
    """The tab's title and the top heading name the model and the input; ``first`` leads; the playground is in
    the closed <details> at the end (one click opens it), its own title beside it."""
    p = o.page
    assert p.title() == title and p.locator("#title").text_content() == title
    got = order(o)
    assert got[0] == first, got
    if playground is None:
        assert p.locator("#more").count() == 0
        return
    assert got[-1] == "more" and p.locator("#more").get_attribute("open") is None
    assert not p.get_by_test_id("playground").is_visible() and not p.get_by_test_id("why").is_visible()
    p.get_by_test_id("more-summary").click()
    assert p.get_by_test_id("playground").is_visible() and p.get_by_test_id("why").is_visible()
    assert p.get_by_test_id("playground-title").text_content() == playground
    assert p.get_by_test_id("weights-2-2").text_content() == "0.9630"          # seed 003's 吃 → 吃, as before


def check_generation(o: Opened, tokens: list[str], P: int, layers: list[np.ndarray], H: int):
    """Each generated token, stepped through: its label, the chips coloured by (layer 0, head 0) with the exact
    weights, and the map's hover over every layer and head at three keys — all Python's rows."""
    p = o.page
    G = len(tokens) - P
    for s in range(G):
        if s:
            p.get_by_test_id("gen-next").click()
        q = P + s
        assert p.get_by_test_id("gen-step").input_value() == str(s)
        label = p.get_by_test_id("gen-label").text_content()
        assert label == f"token {s + 1} of {G}: {tokens[q]}" if o.lang == "en" else label.endswith(tokens[q])
        chips = p.eval_on_selector_all("[data-testid^='gen-tok-']", "els => els.map(e => e.getAttribute('data-w'))")
        assert chips[:q + 1] == [shown(layers[0][0, q, j]) for j in range(q + 1)]
        assert all(c is None for c in chips[q + 1:])
        for row in range(len(layers) * H):
            layer, head = divmod(row, H)
            for j in sorted({0, q // 2, q}):
                assert hover_cell(o, "gen-map", row, j) == shown(layers[layer][head, q, j]), (s, row, j)


@pytest.mark.parametrize("name, lang", [("llama", "en"), ("gemma2", "zh"), ("qwen2", "en")])
def test_the_generation_view_of_a_transformers_folder(browser, tmp_path, folders, name, lang):
    prompt = "the cat sat on"
    path = cli_page(tmp_path, "--hf", folders[name], "--generate", prompt, "-n", "5", "--lang", lang,
                    "--example", "seed003")
    m = qkv.hf.load(folders[name])
    g = generate(m, prompt, max_new_tokens=5)
    ids = g.prompt_ids + g.ids
    layers = list(sequence_attentions(m, ids))
    o = Opened(browser, path)
    o.lang = lang
    try:
        tokens = [m.hf_tokenizer.decode([i]) for i in ids]
        check_generation(o, tokens, len(g.prompt_ids), layers, m.config.num_heads)
        note = o.page.locator("#generation").text_content()
        assert ("qkv.hf.record" in note) and "qkv.models" not in o.page.locator("main").text_content()
        playground = "Seed 003 · 我 爱 吃 (self-attention, one head)" if lang == "en" else "种子 003 · 我 爱 吃（自注意力，单头）"
        check_folded(o, f"tiny-{name} · {prompt}", "generation", playground)
        if lang == "zh":
            assert "本页还有" in o.page.get_by_test_id("more-summary").text_content()
        o.screenshot(f"hf-generation-{name}-{lang}")
        o.check_clean()
    finally:
        o.context.close()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_comparison_shows_pythons_table_and_both_models_weights(browser, tmp_path, folders, lang):
    text = "the cat sat on the mat"
    path = cli_page(tmp_path, "--hf", folders["llama"], "--compare", folders["tuned"], "--text", text, "--lang", lang)
    ref = qkv.hf.compare(qkv.hf.load(folders["llama"]), qkv.hf.load(folders["tuned"]), text)
    o = Opened(browser, path)
    try:
        p = o.page
        rows = p.eval_on_selector_all("[data-testid^='cmp-row-']", """els => els.map(e => [Number(e.dataset.layer),
            Number(e.dataset.head), Number(e.dataset.jsMean), Number(e.dataset.jsMax)])""")
        assert rows == [[r.layer, r.head, r.js_mean, r.js_max] for r in ref.rows]
        for k, r in enumerate(ref.rows):
            assert [p.get_by_test_id(f"cmp-{k}-{c}").text_content() for c in range(4)] == \
                [str(r.layer), str(r.head), f"{r.js_mean:.6f}", f"{r.js_max:.6f}"]
        assert ref.rows[0].layer == 1 and ref.rows[-1].js_mean == 0.0
        for k in (0, 3, 7):
            p.get_by_test_id(f"cmp-row-{k}").click()
            r = ref.rows[k]
            assert p.get_by_test_id(f"cmp-row-{k}").get_attribute("aria-pressed") == "true"
            assert f"{r.js_mean:.6f}" in p.get_by_test_id("cmp-selected").text_content()
            for side, w in (("a", ref.weights_a), ("b", ref.weights_b)):
                for i, j in ((0, 0), (3, 1), (5, 2), (5, 5)):
                    assert hover_cell(o, f"cmp-map-{side}", i, j) == shown(w[r.layer][0, r.head, i, j]), (k, side)
        title = f"tiny-llama {'vs' if lang == 'en' else '对比'} tiny-llama-tuned · {text}"
        check_folded(o, title, "compare", "Seed 003 · 我 爱 吃 (self-attention, one head)" if lang == "en"
                     else "种子 003 · 我 爱 吃（自注意力，单头）")
        o.screenshot(f"hf-compare-{lang}")
        o.check_clean()
    finally:
        o.context.close()


def test_the_model_view_of_a_folder_opens_first_and_says_qkv_hf(browser, tmp_path, folders):
    text = "the cat sat on the mat"
    path = cli_page(tmp_path, "--hf", folders["gemma2"], "--text", text)
    o = Opened(browser, path)
    try:
        words = o.page.locator("#model").text_content()
        assert "computed by qkv (qkv.hf)" in words and "qkv.models" not in words
        w = qkv.hf.load(folders["gemma2"]).run([text]).attentions[1][0]            # (H, T, T)
        o.page.get_by_test_id("thumb-1-3").click()
        assert hover_cell(o, "model-map", 5, 2) == shown(w[3, 5, 2])
        assert hover_cell(o, "model-map", 2, 5) == ""                              # causal: a masked cell
        check_folded(o, f"tiny-gemma2 · {text}", "model", "Seed 003 · 我 爱 吃 (self-attention, one head)")
        o.check_clean()
    finally:
        o.context.close()
