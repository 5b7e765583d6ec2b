"""The page at any size, in Chromium: the canvas views of long inputs (first paint, exact hover, zoom), the
worked example too large to edit, the page's limits said on the page, token text isolated (U+202E), the zh
words of the canvas view, and (model-marked) MiniLM at 512 tokens, SmolLM2 at 1,024 tokens × every layer and
head, and the generation view. The first paint is the time from navigation start to the page's data-ready
marker (``performance.now()``, written as ``data-ready-ms``), asserted ≤ 5 s.
"""
from __future__ import annotations

import inspect
import pathlib

import numpy as np
import pytest

from qkv import viz
from qkv.viz import page as vpage
from test_browser_page import W_K, W_Q, W_V, X, Opened

pytestmark = pytest.mark.browser

FIRST_PAINT_MS = 5000


# ------------------------------------------------------------------------------------------ helpers
def causal_softmax(logits: np.ndarray) -> np.ndarray:
    T = logits.shape[-1]
    x = np.where(np.tri(T, dtype=bool), logits, -np.inf)
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def synthetic_layers(T: int, L: int, H: int, seed: int = 0) -> list[np.ndarray]:
    """Attention-like weights (L layers of (H, T, T), causal, float32): a previous-token head, a first-token sink,
    and noise, so that they compress as real ones do."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(L):
        logits = rng.standard_normal((H, T, T)).astype(np.float32) * 1.5
        idx = np.arange(1, T)
        logits[0, idx, idx - 1] += 8.0
        logits[1 % H, :, 0] += 6.0
        out.append(causal_softmax(logits))
    return out


def model_view(layers, tokens, *, name="synthetic", causal=True, kv_heads=None) -> dict:
    L, H, T = len(layers), layers[0].shape[0], layers[0].shape[-1]
    data = vpage._layers_data(layers, L, H, T, causal, what=name)
    data.update({"kind": "model", "name": name, "text": "a synthetic text", "tokens": tokens, "decoder": causal,
                 "kv_heads": kv_heads or H})
    return data


def open_file(browser, path: pathlib.Path) -> Opened:
    return Opened(browser, path)


def first_paint_ms(o: Opened) -> float:
    return float(o.page.evaluate("document.body.dataset.readyMs"))


def geometry(o: Opened, testid: str):
    c = o.page.get_by_test_id(f"{testid}-canvas")
    c.scroll_into_view_if_needed()
    ml, mt, pw, ph = (float(x) for x in c.get_attribute("data-plot").split())
    r0, r1, c0, c1 = (int(x) for x in c.get_attribute("data-view").split())
    box = c.bounding_box()
    return box, (ml, mt, pw, ph), (r0, r1, c0, c1)


def hover_at(o: Opened, testid: str, i: int, j: int) -> tuple[int, int, str]:
    """Move the pointer to the middle of cell (i, j) of the map view; returns the cell the hover line names and
    the weight it shows ("" for a masked cell). Where cells are under 2 px (the whole map of a long input), the
    pointer's whole-pixel position may fall in a neighbour: that cell is named, within one of (i, j)."""
    box, (ml, mt, pw, ph), (r0, r1, c0, c1) = geometry(o, testid)
    cw, ch = pw / (c1 - c0), ph / (r1 - r0)
    y = box["y"] + mt + (i - r0 + 0.5) * ch
    if not 20 <= y <= 880:                                          # bring that row into the 900 px viewport
        o.page.evaluate(f"window.scrollBy(0, {y - 450})")
        box = o.page.get_by_test_id(f"{testid}-canvas").bounding_box()
        y = box["y"] + mt + (i - r0 + 0.5) * ch
    o.page.mouse.move(box["x"] + ml + (j - c0 + 0.5) * cw, y)
    h = o.page.get_by_test_id(f"{testid}-hover")
    gi, gj = int(h.get_attribute("data-i")), int(h.get_attribute("data-j"))
    assert abs(gi - i) <= (1 if ch < 2 else 0) and abs(gj - j) <= (1 if cw < 2 else 0), ((gi, gj), (i, j))
    return gi, gj, h.get_attribute("data-w")


def hover_cell(o: Opened, testid: str, i: int, j: int) -> str:
    """The weight the hover line shows over cell (i, j) (cells of at least 2 px: exactly that cell)."""
    gi, gj, w = hover_at(o, testid, i, j)
    assert (gi, gj) == (i, j)
    return w


def shown(w: float) -> str:
    return format(float(w), ".3f")


def assert_hover_exact(o: Opened, testid: str, weights: np.ndarray, cells, causal: bool = True):
    """Over each cell: the hover line shows the exact weight (to its 3 decimals) of the cell it names."""
    for i, j in cells:
        gi, gj, got = hover_at(o, testid, int(i), int(j))
        if causal and gj > gi:
            assert got == "", (gi, gj, got)
        else:
            assert got == shown(weights[gi, gj]), (gi, gj, got, weights[gi, gj])


def random_cells(rng, r0, r1, c0, c1, n, causal=True):
    cells = []
    while len(cells) < n:
        i, j = int(rng.integers(r0, r1)), int(rng.integers(c0, c1))
        if not causal or j <= i or len(cells) % 5 == 0:
            cells.append((i, j))
    return cells


# ------------------------------------------------------------------------------------------ tests
def test_a_1024_token_map_paints_fast_hovers_exactly_and_zooms(browser, tmp_path):
    T, L, H = 1024, 2, 2
    layers = synthetic_layers(T, L, H)
    tokens = [f"w{i}" for i in range(T)]
    path = tmp_path / "big.html"
    viz.write_page(path, {"model": model_view(layers, tokens)})
    assert path.stat().st_size <= viz.MAX_PAGE_BYTES
    o = open_file(browser, path)
    try:
        assert first_paint_ms(o) <= FIRST_PAINT_MS
        assert o.page.eval_on_selector_all("[data-testid^='thumb-']", "els => els.length") == L * H
        canvas = o.page.get_by_test_id("model-map-canvas")
        assert canvas.get_attribute("data-view") == f"0 {T} 0 {T}"
        rng = np.random.default_rng(1)
        # The whole map (pixels pool several cells): the hover still names one cell and its exact weight.
        assert_hover_exact(o, "model-map", layers[0][0], random_cells(rng, 0, T, 0, T, 25) + [(1, 0), (T - 1, T - 2)])
        assert "largest of" in o.page.get_by_test_id("model-map-hover").text_content()
        # Zoom into a region by dragging a rectangle: rows 100–139, columns 90–129.
        box, (ml, mt, pw, ph), _ = geometry(o, "model-map")
        at = lambda i, j: (box["x"] + ml + (j + 0.5) * pw / T, box["y"] + mt + (i + 0.5) * ph / T)  # noqa: E731
        o.page.mouse.move(*at(100, 90))
        o.page.mouse.down()
        o.page.mouse.move(*at(120, 110), steps=4)
        o.page.mouse.move(*at(139, 129), steps=4)
        o.page.mouse.up()
        r0, r1, c0, c1 = (int(v) for v in canvas.get_attribute("data-view").split())
        assert abs(r0 - 100) <= 1 and abs(r1 - 140) <= 1 and abs(c0 - 90) <= 1 and abs(c1 - 130) <= 1
        assert canvas.get_attribute("data-pool") == "1 1"
        assert_hover_exact(o, "model-map", layers[0][0], random_cells(rng, r0, r1, c0, c1, 20)
                           + [(r0, c0), (r1 - 1, c1 - 1)])
        assert "largest of" not in o.page.get_by_test_id("model-map-hover").text_content()
        o.screenshot("scale-1024-zoomed")
        # Keys: the arrows move the cell under the cursor, + zooms in around it, 0 shows the whole map again.
        canvas.focus()
        start = (int(o.page.get_by_test_id("model-map-hover").get_attribute("data-i")),
                 int(o.page.get_by_test_id("model-map-hover").get_attribute("data-j")))
        o.page.keyboard.press("ArrowLeft")
        o.page.keyboard.press("ArrowDown")
        h = o.page.get_by_test_id("model-map-hover")
        i, j = int(h.get_attribute("data-i")), int(h.get_attribute("data-j"))
        assert (i, j) == (start[0] + 1, start[1] - 1)
        assert h.get_attribute("data-w") == (shown(layers[0][0][i, j]) if j <= i else "")
        o.page.keyboard.press("+")
        r0b, r1b, _, _ = (int(v) for v in canvas.get_attribute("data-view").split())
        assert r1b - r0b < r1 - r0 and r0b <= i < r1b
        o.page.keyboard.press("0")
        assert canvas.get_attribute("data-view") == f"0 {T} 0 {T}"
        # The wheel zooms around the pointer; the buttons zoom and reset.
        box, (ml, mt, pw, ph), _ = geometry(o, "model-map")
        o.page.mouse.move(box["x"] + ml + pw / 2, box["y"] + mt + ph / 2)
        o.page.mouse.wheel(0, -200)
        r0c, r1c, _, _ = (int(v) for v in canvas.get_attribute("data-view").split())
        assert r1c - r0c < T and r0c <= T // 2 < r1c
        o.page.get_by_test_id("model-map-zoom-in").click()
        o.page.get_by_test_id("model-map-reset").click()
        assert canvas.get_attribute("data-view") == f"0 {T} 0 {T}"
        # Another head: its own weights, exactly.
        o.page.get_by_test_id("thumb-1-1").click()
        assert o.page.get_by_test_id("model-selected").text_content() == "layer 1, head 1"
        assert_hover_exact(o, "model-map", layers[1][1], random_cells(rng, 0, T, 0, T, 12) + [(T - 1, 0)])
        # The √ colour scale redraws without changing a number.
        o.page.get_by_test_id("model-map-scale").select_option("sqrt")
        assert_hover_exact(o, "model-map", layers[1][1], [(500, 0), (T - 1, T - 1)])
        o.screenshot("scale-1024")
        o.check_clean()
    finally:
        o.context.close()


def test_a_worked_example_too_large_to_edit_is_shown_as_a_picture(browser, tmp_path):
    from qkv.explain import examples

    rng = np.random.default_rng(3)
    T, D = 300, 8
    doc = {"title": "300 tokens", "tokens": [f"t{i}" for i in range(T)], "heads": 2,
           "X": rng.standard_normal((T, D)).round(3).tolist(),
           "W_Q": rng.standard_normal((D, D)).round(3).tolist(), "W_K": rng.standard_normal((D, D)).round(3).tolist(),
           "W_V": rng.standard_normal((D, D)).round(3).tolist(), "mask": "causal"}
    worked = examples.from_dict(doc)
    data = viz.worked_data(worked)
    assert data["kind"] == "example" and data["heads"] == 2
    assert data["notices"][0]["key"] == "page.playground_too_big"
    path = tmp_path / "ex.html"
    viz.write_page(path, {"example": data})
    want = np.asarray(examples.run(worked)["weights"].array).reshape(2, T, T)
    o = open_file(browser, path)
    try:
        assert first_paint_ms(o) <= FIRST_PAINT_MS
        notice = o.page.get_by_test_id("notice-0").text_content()
        assert f"up to {vpage.PLAYGROUND_MAX_CELLS} cells" in notice and "qkv explain" in notice
        assert o.page.get_by_test_id("playground").is_hidden()
        assert o.page.get_by_test_id("title").text_content() == "300 tokens"
        rng = np.random.default_rng(4)
        o.page.get_by_test_id("example-thumb-0-1").click()
        assert_hover_exact(o, "example-map", want[1], random_cells(rng, 0, T, 0, T, 20, causal=False),
                           causal=False)
        o.check_clean()
    finally:
        o.context.close()


def test_an_example_over_the_limit_says_so_on_the_page_and_in_the_cli(browser, tmp_path, capsys):
    import yaml

    from qkv.cli import main

    n = vpage.EXAMPLE_MAX_TOKENS + 1
    f = tmp_path / "huge.yaml"
    f.write_text(yaml.safe_dump({"title": "huge", "tokens": [f"t{i}" for i in range(n)], "Q": [[1.0, 0.0]] * n,
                                 "K": [[0.0, 1.0]] * n}), encoding="utf-8")
    out = tmp_path / "huge.html"
    assert main(["view", str(f), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"limit of {vpage.EXAMPLE_MAX_TOKENS} tokens a side" in err and err.count("\n") == 1
    o = open_file(browser, out)
    try:
        text = o.page.get_by_test_id("notice-0").text_content()
        assert f"{n} queries × {n} keys" in text and str(vpage.EXAMPLE_MAX_TOKENS) in text
        o.check_clean()
    finally:
        o.context.close()


RLO = "\u202e"


def test_a_right_to_left_override_in_a_token_cannot_reverse_the_arithmetic_line(browser, tmp_path):
    tokens = [RLO + "evil", "爱", "吃"]
    path = tmp_path / "bidi.html"
    T = 40
    layers = synthetic_layers(T, 1, 2, seed=5)
    viz.write_page(path, {"playground": viz.playground_data(X, W_Q, W_K, W_V, tokens=tokens),
                          "model": model_view(layers, [RLO + "evil"] + [f"w{i}" for i in range(1, T)])})
    o = open_file(browser, path)
    try:
        o.page.get_by_test_id("Q-0-0").hover()
        arith = o.page.get_by_test_id("arith")
        text = arith.text_content()
        assert text == f"Q[{RLO}evil, 0] = 1.2×0.1 + 0.8×0.4 + (−0.5)×0.7 + 0.3×1.0 = 0.39"
        assert arith.evaluate("e => [...e.querySelectorAll('bdi')].map(b => b.textContent)") == [RLO + "evil"]
        # Laid out left to right around the token: "Q[", then the token, then ", 0] = … = 0.39" still left to right
        # (an unbalanced U+202E outside an isolate would reverse everything after it).
        pos = arith.evaluate("""e => {
            const nodes = [...e.childNodes], r = document.createRange();
            const ch = (n, k) => { r.setStart(n, k); r.setEnd(n, k + 1); return r.getBoundingClientRect(); };
            const [before, bdi, after] = nodes;
            const b = bdi.getBoundingClientRect();
            return {before: before.textContent, beforeRight: ch(before, before.length - 1).right,
                    bdiLeft: b.left, bdiRight: b.right, after: after.textContent,
                    afterFirst: ch(after, 0).left, afterSecond: ch(after, 2).left,
                    afterLast: ch(after, after.length - 1).left};
        }""")
        assert pos["before"] == "Q[" and pos["after"].endswith("= 0.39")
        assert pos["beforeRight"] <= pos["bdiLeft"] + 0.5 and pos["bdiRight"] <= pos["afterFirst"] + 0.5
        assert pos["afterFirst"] < pos["afterSecond"] < pos["afterLast"]
        # The weights' hover line in the canvas view isolates the token too.
        hover_cell(o, "model-map", 0, 0)
        h = o.page.get_by_test_id("model-map-hover")
        assert h.evaluate("e => [...e.querySelectorAll('bdi')].map(b => b.textContent)")[0] == RLO + "evil"
        assert h.text_content().endswith(": " + shown(layers[0][0][0, 0]))
        o.screenshot("bidi")
        o.check_clean()
    finally:
        o.context.close()


def test_the_canvas_view_in_chinese(browser, tmp_path):
    layers = synthetic_layers(64, 1, 1, seed=6)
    path = tmp_path / "zh.html"
    viz.write_page(path, {"model": model_view(layers, [f"词{i}" for i in range(64)])}, lang="zh")
    o = open_file(browser, path)
    try:
        assert o.page.get_by_test_id("model-map-zoom-in").text_content() == "放大"
        assert o.page.get_by_test_id("model-map-reset").text_content() == "整张图"
        hover_cell(o, "model-map", 10, 3)
        assert "查询 10" in o.page.get_by_test_id("model-map-hover").text_content()
        hover_cell(o, "model-map", 3, 10)
        assert "被遮蔽" in o.page.get_by_test_id("model-map-hover").text_content()
        assert "显示第 0–63 行" in o.page.get_by_test_id("model-map-region").text_content()
        o.check_clean()
    finally:
        o.context.close()


# ------------------------------------------------------------------------------------------ real models
@pytest.fixture(scope="module")
def llama():
    models = pytest.importorskip("qkv.models")
    try:
        return models.load_llama()
    except ImportError as exc:                                      # the model package is not installed
        pytest.skip(f"no SmolLM2: {exc}")


def exactly_tokens(model, source: str, n: int) -> str:
    """A prefix of ``source`` that the model's tokenizer reads as exactly ``n`` tokens."""
    ids = model.encode(source)
    for extra in range(0, 8):
        for k in (n + extra, n - extra):
            text = model.tokenizer.decode(ids[:k])
            if len(model.encode(text)) == n:
                return text
    raise AssertionError(f"no prefix of exactly {n} tokens")


@pytest.mark.model
def test_smollm2_1024_tokens_every_layer_and_head(browser, tmp_path, llama):
    import difflib

    text = exactly_tokens(llama, inspect.getsource(difflib), 1024)
    data = viz.model_data(text, model=llama)
    assert data["T"] == 1024 and data["layers"] == 30 and data["heads"] == 9 and data["decoder"]
    path = tmp_path / "smollm2-1024.html"
    viz.write_page(path, {"model": data})
    size = path.stat().st_size
    assert size <= viz.MAX_PAGE_BYTES, size
    ids = llama.encode(text)
    first = [w for _, w in zip(range(2), vpage.decoder_attentions(llama, ids))]     # layers 0 and 1 only
    o = open_file(browser, path)
    try:
        ms = first_paint_ms(o)
        assert ms <= FIRST_PAINT_MS, ms
        print(f"\nSmolLM2 1,024 tokens × 30 × 9: {size / 1e6:.1f} MB, first paint {ms:.0f} ms")
        assert o.page.eval_on_selector_all("[data-testid^='thumb-']", "els => els.length") == 270
        rng = np.random.default_rng(7)
        for layer, head in ((0, 0), (1, 5)):
            o.page.get_by_test_id(f"thumb-{layer}-{head}").click()
            assert_hover_exact(o, "model-map", first[layer][head], random_cells(rng, 0, 1024, 0, 1024, 12))
        o.page.get_by_test_id("thumb-29-8").click()                   # the last head: as page.py coded it
        K = vpage.decode_maps({**data["maps"], "blobs": [data["maps"]["blobs"][29 * 9 + 8]],
                               "table_of": [data["maps"]["table_of"][29 * 9 + 8]], "shapes": [[1024, 1024]],
                               "causal": [True]})[0]
        for i, j in random_cells(rng, 0, 1024, 0, 1024, 10):
            gi, gj, got = hover_at(o, "model-map", i, j)
            assert got == ("" if gj > gi else f"{K[gi, gj] / 1000:.3f}")
        o.screenshot("smollm2-1024")
        o.check_clean()
    finally:
        o.context.close()


@pytest.mark.model
def test_minilm_512_tokens_every_layer_and_head(browser, tmp_path):
    import difflib
    import warnings

    models = pytest.importorskip("qkv.models")
    try:
        model = models.load_bert()
    except ImportError as exc:
        pytest.skip(f"no model: {exc}")
    text = " ".join(inspect.getdoc(getattr(difflib, n)) or "" for n in ("SequenceMatcher", "Differ", "unified_diff",
                                                                         "ndiff", "HtmlDiff", "get_close_matches"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                             # truncated to 512 tokens, as the model does
        data = viz.model_data(text, model=model)
        out = model.run([text])
    assert data["T"] == 512 and data["layers"] * data["heads"] == 72 and data["name"] == "all-MiniLM-L6-v2"
    path = tmp_path / "minilm-512.html"
    viz.write_page(path, {"model": data})
    o = open_file(browser, path)
    try:
        ms = first_paint_ms(o)
        assert ms <= FIRST_PAINT_MS, ms
        print(f"\nMiniLM 512 tokens × 6 × 12: {path.stat().st_size / 1e6:.1f} MB, first paint {ms:.0f} ms")
        rng = np.random.default_rng(8)
        for layer, head in ((0, 0), (5, 11)):
            o.page.get_by_test_id(f"thumb-{layer}-{head}").click()
            want = np.asarray(out.attentions[layer])[0, head]
            assert_hover_exact(o, "model-map", want, random_cells(rng, 0, 512, 0, 512, 12, causal=False),
                               causal=False)
        o.check_clean()
    finally:
        o.context.close()


@pytest.mark.model
def test_the_generation_view(browser, tmp_path, llama, capsys):
    from qkv.cli import main

    out = tmp_path / "gen.html"
    prompt = "The capital of France is"
    assert main(["view", "--model", "smollm2", "--generate", prompt, "-n", "6", "-o", str(out)]) == 0
    g = llama.generate(prompt, max_new_tokens=6)
    ids = list(g.prompt_ids) + list(g.ids)
    P, G = len(g.prompt_ids), len(g.ids)
    ref = list(vpage.decoder_attentions(llama, ids))                 # per layer (9, T, T)
    # The page's claim: with the causal mask, a token's row in one pass over prompt + continuation is the row
    # its own decoding step computes (here: the cached step of generated token 2, traced).
    from qkv import Trace

    q = P + 2
    caches = llama.new_caches()
    x = llama.embed(np.asarray([ids[:q]]))
    for layer, cache in zip(llama._layers, caches):
        x = llama._layer(x, layer, cache=cache)
    x = llama.embed(np.asarray([[ids[q]]]))
    for li, (layer, cache) in enumerate(zip(llama._layers, caches)):
        t = Trace()
        x = llama._layer(x, layer, cache=cache, trace=t)
        np.testing.assert_allclose(t["weights"].array[0, :, 0], ref[li][:, q, :q + 1], atol=2e-5)
    o = open_file(browser, out)
    try:
        assert first_paint_ms(o) <= FIRST_PAINT_MS
        assert o.page.get_by_test_id("gen-text").text_content().endswith(g.text)
        toks = llama.token_texts(ids)
        for s in range(G):
            if s:
                o.page.get_by_test_id("gen-next").click()
            q = P + s
            visible = toks[q].replace("\n", "\u21b5").replace("\t", "\u21e5")       # a line break shows as ↵
            assert o.page.get_by_test_id("gen-label").text_content() == f"token {s + 1} of {G}: {visible}"
            assert o.page.get_by_test_id("gen-step").input_value() == str(s)
            for row in (0, 4 * 9 + 2, 29 * 9 + 8):                   # (layer, head) = (0, 0), (4, 2), (29, 8)
                for j in (0, q // 2, q):
                    gi, gj, got = hover_at(o, "gen-map", row, j)
                    layer, head = divmod(gi, 9)
                    assert got == shown(ref[layer][head, q, gj])
            # Chips: coloured by the picked row (layer 0, head 0 until one is picked), exact in data-w.
            chips = o.page.eval_on_selector_all("[data-testid^='gen-tok-']",
                                                "els => els.map(e => e.getAttribute('data-w'))")
            assert chips[:q + 1] == [shown(ref[0][0, q, j]) for j in range(q + 1)]
            assert all(c is None for c in chips[q + 1:])
        # Pick another layer and head by clicking its row: the tokens are coloured by it.
        box, (ml, mt, pw, ph), (r0, r1, c0, c1) = geometry(o, "gen-map")
        row = 29 * 9 + 8
        o.page.mouse.click(box["x"] + ml + 0.5 * pw / (c1 - c0), box["y"] + mt + (row - r0 + 0.5) * ph / (r1 - r0))
        assert "layer 29, head 8" in o.page.get_by_test_id("gen-selected").text_content()
        q = P + G - 1
        assert o.page.get_by_test_id(f"gen-tok-{q}").get_attribute("data-w") == shown(ref[29][8, q, q])
        o.page.get_by_test_id("gen-prev").click()
        assert o.page.get_by_test_id("gen-step").input_value() == str(G - 2)
        o.screenshot("generation")
        o.check_clean()
    finally:
        o.context.close()


def test_heads_at_a_glance_and_rollout_on_the_page(browser, tmp_path):
    T, L, H = 200, 3, 4
    layers = synthetic_layers(T, L, H, seed=9)
    tokens = [f"w{i % 50}" for i in range(T)]
    data = vpage._layers_data(layers, L, H, T, True, what="synthetic", tokens=tokens)
    data.update({"kind": "model", "name": "synthetic", "text": "a synthetic text", "tokens": tokens,
                 "decoder": True, "kv_heads": H})
    kinds = viz.head_kinds(layers, tokens, causal=True)
    R = viz.rollout(layers)
    path = tmp_path / "kinds.html"
    viz.write_page(path, {"model": data})
    o = open_file(browser, path)
    try:
        got = o.page.eval_on_selector_all("[data-testid^='thumb-']", "els => els.map(e => e.dataset.kind)")
        assert got == [str(k) for k in kinds.kind.ravel()]
        assert got[0] == "previous"                                   # head 0 of every layer: the previous token
        label = o.page.get_by_test_id("thumb-0-0").locator(".kind").text_content()
        assert label == f"P{min(99, round(100 * kinds.scores['previous'][0, 0]))}"
        assert "P previous token" in o.page.get_by_test_id("kinds-note").text_content()
        assert o.page.get_by_test_id("rollout-title").text_content() == "Rollout through the layers"
        rng = np.random.default_rng(10)
        assert_hover_exact(o, "rollout-map", R, random_cells(rng, 0, T, 0, T, 15) + [(T - 1, 0), (5, 5)])
        o.check_clean()
    finally:
        o.context.close()
