"""The offline page in a real browser (Debian's Chromium driven by Playwright), held to qkv's numbers.

The page's JavaScript is a second implementation of attention; every number it displays is compared with
qkv's Python path (``qkv.attention`` with a Trace) at the precision the page shows. Every network request is
blocked and any attempt fails the test; console errors fail it too. Screenshots go to artifacts/screenshots/.
A missing Chromium fails these tests (it does not skip them).
"""
from __future__ import annotations

import os
import pathlib
import re

import numpy as np
import pytest

import qkv
from qkv import viz

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = pathlib.Path(__file__).resolve().parents[3] / "artifacts" / "screenshots"
MATRICES = ("Q", "K", "V", "scores", "scaled", "weights", "output")

# Seed 003's numbers, typed from the seed (我 爱 吃; W_K = W_Q + 0.1, W_V = W_Q + 0.2).
TOKENS = ["我", "爱", "吃"]
X = np.array([[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]])
W_Q = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
W_K = np.array([[0.2, 0.3, 0.4], [0.5, 0.6, 0.7], [0.8, 0.9, 1.0], [1.1, 1.2, 1.3]])
W_V = np.array([[0.3, 0.4, 0.5], [0.6, 0.7, 0.8], [0.9, 1.0, 1.1], [1.2, 1.3, 1.4]])


# ------------------------------------------------------------------------------------------ fixtures
# browser: the session's Chromium, in conftest.py (shared with test_browser_scale.py).


def test_chromium_is_there():
    """CI installs Debian's chromium; without it the browser tests fail instead of skipping."""
    assert os.path.exists(CHROMIUM), f"install Debian's chromium ({CHROMIUM}): apt-get install chromium"


class Opened:
    """A page loaded from file:// with every network request blocked and its console watched."""

    def __init__(self, browser, path: pathlib.Path):
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.requests, self.blocked, self.errors, self.dialogs = [], [], [], []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}")
                     if m.type in ("error", "warning", "assert") else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", self._dialog)
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("body[data-ready='true']")

    def _route(self, route):
        url = route.request.url
        if url.startswith(("file:", "data:")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def _dialog(self, dialog):
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def check_clean(self):
        """No network request was attempted, nothing went to the console as an error, no dialog opened."""
        assert self.blocked == []
        assert [u for u in self.requests if not u.startswith(("file:", "data:"))] == []
        assert self.errors == []
        assert self.dialogs == []

    def screenshot(self, name: str):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def cells(self) -> dict[str, str]:
        """Every displayed cell, by data-testid, in one round trip."""
        return self.page.eval_on_selector_all(
            "td[data-testid]", "els => Object.fromEntries(els.map(e => [e.dataset.testid, e.textContent]))")

    def fill(self, testid: str, text: str):
        self.page.get_by_test_id(testid).fill(text)


@pytest.fixture
def open_page(browser, tmp_path):
    opened = []

    def _open(data: dict, name: str = "page") -> Opened:
        path = tmp_path / f"{name}.html"
        viz.write_page(path, data)
        o = Opened(browser, path)
        opened.append(o)
        return o

    yield _open
    for o in opened:
        o.context.close()


# ------------------------------------------------------------------------------------------ the reference
def qkv_reference(X, W_Q, W_K, W_V, *, heads=1, causal=False, scaling=True, mask=None, X_kv=None):
    """What qkv computes, per head, from its traces: Q, K, V (all heads), per-head scores/scaled/weights,
    and the heads' outputs side by side."""
    E, Ev = W_Q.shape[1] // heads, W_V.shape[1] // heads
    if mask is not None and causal:                                 # qkv takes one or the other; combine them
        mask, causal = qkv.masks.combine(qkv.masks.causal(*mask.shape), mask), False
    per_head = []
    for h in range(heads):
        t = qkv.Trace()
        qkv.attention(X, W_Q[:, h * E:(h + 1) * E], W_K[:, h * E:(h + 1) * E], W_V[:, h * Ev:(h + 1) * Ev],
                      x_kv=X_kv, attn_mask=mask, is_causal=causal, scale=None if scaling else 1.0, trace=t)
        per_head.append(t)
    cat = lambda name: np.concatenate([t[name].array for t in per_head], axis=-1)
    return {"Q": cat("Q"), "K": cat("K"), "V": cat("V"), "output": cat("output"),
            "heads": [{n: t[n].array for n in ("scores", "scaled", "weights")} for t in per_head]}


def assert_displayed(cells: dict[str, str], name: str, expected: np.ndarray):
    """Every cell of matrix ``name`` is shown, and shows ``expected`` rounded to the displayed decimals."""
    shown = {k: v for k, v in cells.items() if re.fullmatch(rf"{re.escape(name)}-\d+-\d+", k)}
    assert len(shown) == expected.size, f"{name}: {len(shown)} cells shown, expected {expected.shape}"
    for i in range(expected.shape[0]):
        for j in range(expected.shape[1]):
            text = shown[f"{name}-{i}-{j}"]
            assert re.fullmatch(r"-?\d+\.\d+", text), f"{name}-{i}-{j}: {text!r}"
            decimals = len(text.split(".")[1])
            want = float(expected[i, j])
            assert abs(float(text) - want) <= 0.5 * 10 ** -decimals + 1e-9 * max(1.0, abs(want)), \
                f"{name}[{i},{j}] shows {text}, qkv computed {want!r}"


def assert_matches_qkv(o: Opened, X, W_Q, W_K, W_V, *, heads=1, causal=False, scaling=True, mask=None, X_kv=None):
    ref = qkv_reference(X, W_Q, W_K, W_V, heads=heads, causal=causal, scaling=scaling, mask=mask, X_kv=X_kv)
    for h in range(heads):
        if heads > 1:
            o.page.get_by_test_id(f"head-tab-{h}").click()
        cells = o.cells()
        for name in ("Q", "K", "V", "output"):
            assert_displayed(cells, name, ref[name])
        for name in ("scores", "scaled", "weights"):
            assert_displayed(cells, name, ref["heads"][h][name])
    return ref


def seed_page() -> dict:
    return {"playground": viz.playground_data(X, W_Q, W_K, W_V, tokens=TOKENS, title="seed 003: 我 爱 吃")}


# ------------------------------------------------------------------------------------------ tests
def test_seed003_page_shows_qkvs_numbers(open_page):
    o = open_page(seed_page(), "seed003")
    ref = assert_matches_qkv(o, X, W_Q, W_K, W_V)
    cells = o.cells()
    # Hand-checked in seed 003: 我_Q = [0.39, 0.57, 0.75], 我_K = [0.57, 0.75, 0.93], 我_V = [0.75, 0.93, 1.11].
    assert [cells[f"Q-0-{j}"] for j in range(3)] == ["0.3900", "0.5700", "0.7500"]
    assert [cells[f"K-0-{j}"] for j in range(3)] == ["0.5700", "0.7500", "0.9300"]
    assert [cells[f"V-0-{j}"] for j in range(3)] == ["0.7500", "0.9300", "1.1100"]
    np.testing.assert_allclose(ref["Q"][0], [0.39, 0.57, 0.75], atol=1e-12)
    # The row labels are the tokens, on both axes of the attention matrices.
    assert [o.page.get_by_test_id(f"weights-row-{i}").text_content() for i in range(3)] == TOKENS
    assert [o.page.get_by_test_id(f"weights-col-{j}").text_content() for j in range(3)] == TOKENS
    # Inputs are <input>s holding the data.
    for name, M in (("X", X), ("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
        for (i, j), v in np.ndenumerate(M):
            loc = o.page.get_by_test_id(f"{name}-{i}-{j}")
            assert loc.evaluate("e => e.tagName") == "INPUT"
            assert float(loc.input_value()) == v
    o.screenshot("seed003")
    o.check_clean()


def explain_text(worked, **kw) -> str:
    """qkv explain's rendering of a worked example (the hover text must be written the same way)."""
    import importlib
    examples = pytest.importorskip("qkv.explain.examples")
    render = importlib.import_module("qkv.explain.render")
    return render.render(examples.run(worked, **kw), tokens=worked.tokens, kv_tokens=worked.kv_tokens)


def hover(o: Opened, testid: str) -> str:
    o.page.get_by_test_id(testid).hover()
    text = o.page.get_by_test_id("arith").text_content()
    assert o.page.get_by_test_id(testid).get_attribute("title") == text
    return text


@pytest.mark.parametrize("name, causal", [("seed003", False), ("causal", True), ("two_head", False),
                                          ("seed000", False), ("cross", False)])
def test_hover_shows_the_arithmetic_as_explain_writes_it(open_page, name, causal):
    examples = pytest.importorskip("qkv.explain.examples")
    worked = examples.load_example(name)
    o = open_page({"playground": viz.from_worked(worked)}, f"hover-{name}")
    explained = explain_text(worked)
    lines = {line.strip() for line in explained.splitlines()}
    cells = o.cells()
    hovered = 0
    for testid in sorted(cells):
        m = re.fullmatch(r"(Q|K|V|scores|scaled|weights|output|final_output)-(\d+)-(\d+)", testid)
        if not m or (int(m.group(2)) + int(m.group(3))) % 2:        # every other cell keeps the test quick
            continue
        text = hover(o, testid)
        for line in text.splitlines():
            # a whole line of qkv explain's output, or (the one key's division of a softmax row) a part of one
            assert line.strip() in lines or (testid.startswith("weights") and line.strip() in explained), \
                f"{testid}: {line.strip()!r} is not written as qkv explain writes it"
        hovered += 1
    assert hovered >= 5
    if name == "seed003":
        assert hover(o, "Q-0-0") == "Q[我, 0] = 1.2×0.1 + 0.8×0.4 + (−0.5)×0.7 + 0.3×1.0 = 0.39"
    o.check_clean()


def run_reference(worked, **kw) -> dict:
    """The page's matrices from qkv.explain.examples.run (qkv's own path), per head where there are heads."""
    examples = pytest.importorskip("qkv.explain.examples")
    t = examples.run(worked, **kw)
    two_d = lambda a: np.asarray(a).reshape(-1, *np.shape(a)[-2:])   # (..., R, C) -> (slices, R, C)
    ref = {"heads": [{n: two_d(t[n].array)[h] for n in ("scores", "scaled", "weights") if n in t}
                     for h in range(two_d(t["weights"].array).shape[0])]}
    for n in ("Q", "K", "V"):
        if n in t and t[n].op != "input":
            ref[n] = two_d(t[n].array)[0]
    if "concat" in t:
        ref["output"], ref["final_output"] = t["concat"].array[0], t["final_output"].array[0]
    elif "output" in t:
        ref["output"] = two_d(t["output"].array)[0]
    return ref


def assert_matches_run(o: Opened, ref: dict):
    H = len(ref["heads"])
    for h in range(H):
        if H > 1:
            o.page.get_by_test_id(f"head-tab-{h}").click()
        cells = o.cells()
        for name in ("Q", "K", "V", "output", "final_output"):
            if name in ref:
                assert_displayed(cells, name, ref[name])
        for name, M in ref["heads"][h].items():
            if name != "scores" or any(k.startswith("scores-") for k in cells):   # given scores are inputs
                assert_displayed(cells, name, M)


def test_every_builtin_example_matches_qkv(open_page):
    examples = pytest.importorskip("qkv.explain.examples")
    for name in examples.builtin_names():
        worked = examples.load_example(name)
        o = open_page({"playground": viz.from_worked(worked)}, f"example-{name}")
        assert o.page.get_by_test_id("title").text_content() == worked.title
        assert_matches_run(o, run_reference(worked))
        if not isinstance(worked.mask, str):
            o.page.get_by_test_id("toggle-causal").check()
            L, S = worked.n_queries, worked.n_keys
            mask = qkv.masks.causal(L, S) if worked.mask is None else qkv.masks.combine(qkv.masks.causal(L, S), worked.mask)
            assert_matches_run(o, run_reference(worked, mask=mask))
        o.screenshot(f"example-{name}")
        o.check_clean()


def test_editing_inputs_recomputes_everything(open_page):
    o = open_page(seed_page())
    X2, WQ2, WV2 = X.copy(), W_Q.copy(), W_V.copy()
    for testid, text, (M, i, j) in (("X-0-0", "2.5", (X2, 0, 0)), ("X-2-3", "-1.25", (X2, 2, 3)),
                                    ("W_Q-1-2", "0.05", (WQ2, 1, 2)), ("W_V-3-0", "−0.7", (WV2, 3, 0))):
        o.fill(testid, text)
        M[i, j] = float(text.replace("−", "-"))
    assert_matches_qkv(o, X2, WQ2, W_K, WV2)
    # Keyboard users get the arithmetic on focus too.
    o.page.get_by_test_id("K-1-2").focus()
    assert o.page.get_by_test_id("arith").text_content().startswith("K[爱, 2] = 0.5×0.4 + ")
    o.page.get_by_test_id("reset").click()                          # back to the starting data
    assert o.page.get_by_test_id("X-0-0").input_value() == "1.2"
    assert_matches_qkv(o, X, W_Q, W_K, W_V)
    o.check_clean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_inputs_typed_into_the_page(open_page, seed):
    rng = np.random.default_rng(seed)
    L, D, E = 3 + seed, 4, 4
    start = [rng.normal(size=s).round(3) for s in ((L, D), (D, E), (D, E), (D, E))]
    o = open_page({"playground": viz.playground_data(*start)}, f"random{seed}")
    assert_matches_qkv(o, *start)                                   # the embedded data, exactly
    typed = [rng.normal(scale=1.5, size=m.shape).round(3) for m in start]
    for name, M in zip(("X", "W_Q", "W_K", "W_V"), typed):
        for (i, j), v in np.ndenumerate(M):
            o.fill(f"{name}-{i}-{j}", repr(float(v)))
    assert_matches_qkv(o, *typed)
    o.page.get_by_test_id("toggle-causal").check()
    assert_matches_qkv(o, *typed, causal=True)
    o.page.get_by_test_id("heads-select").select_option("2")
    assert_matches_qkv(o, *typed, causal=True, heads=2)
    o.check_clean()


def test_causal_toggle(open_page):
    o = open_page(seed_page())
    o.page.get_by_test_id("toggle-causal").check()
    cells = o.cells()
    for i in range(3):
        for j in range(3):
            assert cells[f"mask-{i}-{j}"] == ("1" if j <= i else "0")
            if j > i:
                assert float(cells[f"weights-{i}-{j}"]) == 0.0
    assert cells["weights-0-0"] == "1.0000"
    assert_matches_qkv(o, X, W_Q, W_K, W_V, causal=True)
    o.screenshot("seed003-causal")
    o.page.get_by_test_id("toggle-causal").uncheck()
    assert_matches_qkv(o, X, W_Q, W_K, W_V, causal=False)
    o.check_clean()


def test_scaling_toggle(open_page):
    o = open_page(seed_page())
    before = max(float(v) for k, v in o.cells().items() if k.startswith("weights-"))
    o.page.get_by_test_id("toggle-scale").uncheck()
    ref = assert_matches_qkv(o, X, W_Q, W_K, W_V, scaling=False)
    np.testing.assert_array_equal(ref["heads"][0]["scaled"], ref["heads"][0]["scores"])
    after = max(float(v) for k, v in o.cells().items() if k.startswith("weights-"))
    assert after > before                                           # softmax saturates without 1/√d_k
    o.screenshot("seed003-unscaled")
    o.check_clean()


def test_heads(open_page):
    o = open_page(seed_page())
    options = o.page.get_by_test_id("heads-select").evaluate("s => [...s.options].map(o => o.value)")
    assert options == ["1", "3"]                                    # the divisors of d = 3
    o.page.get_by_test_id("heads-select").select_option("3")
    assert_matches_qkv(o, X, W_Q, W_K, W_V, heads=3)               # clicks every head's tab
    assert o.page.get_by_test_id("head-tab-2").get_attribute("aria-pressed") == "true"
    assert o.page.get_by_test_id("head-note").text_content().startswith("Head 2 uses column 2 of Q and K and column 2 of V (d_k = 1)")
    assert o.page.get_by_test_id("scores-table").locator("caption").text_content().startswith("scores (head 2)")
    o.screenshot("seed003-3-heads")
    o.check_clean()


def test_heads_concat_matches_multihead_attention(open_page):
    rng = np.random.default_rng(7)
    D, H = 4, 2
    Xr, WQ, WK, WV = (rng.normal(size=s).round(3) for s in ((5, D), (D, D), (D, D), (D, D)))
    o = open_page({"playground": viz.playground_data(Xr, WQ, WK, WV, heads=H)})
    assert_matches_qkv(o, Xr, WQ, WK, WV, heads=H)
    mha = qkv.MultiHeadAttention(D, H, bias=False, dtype=np.float64).load(W_Q=WQ, W_K=WK, W_V=WV, W_O=np.eye(D))
    t = qkv.Trace()
    mha(Xr, trace=t)
    assert_displayed(o.cells(), "output", t["concat"].array[0])
    o.check_clean()


def test_final_output_with_w_o(open_page):
    rng = np.random.default_rng(11)
    D, H = 4, 2
    Xr, WQ, WK, WV, WO = (rng.normal(size=s).round(3) for s in ((3, D), (D, D), (D, D), (D, D), (D, D)))
    o = open_page({"playground": viz.playground_data(Xr, WQ, WK, WV, W_O=WO, heads=H)})
    mha = qkv.MultiHeadAttention(D, H, bias=False, dtype=np.float64).load(W_Q=WQ, W_K=WK, W_V=WV, W_O=WO)
    t = qkv.Trace()
    mha(Xr, trace=t)
    assert_displayed(o.cells(), "final_output", t["final_output"].array[0])
    o.check_clean()


def test_an_examples_mask_and_a_fully_masked_row(open_page):
    rng = np.random.default_rng(5)
    Xr, WQ, WK, WV = (rng.normal(size=s).round(3) for s in ((4, 4), (4, 4), (4, 4), (4, 2)))
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]], bool)   # row 2 sees nothing
    o = open_page({"playground": viz.playground_data(Xr, WQ, WK, WV, mask=mask)})
    ref = assert_matches_qkv(o, Xr, WQ, WK, WV, mask=mask)
    cells = o.cells()
    assert [[cells[f"mask-{i}-{j}"] for j in range(4)] for i in range(4)] == mask.astype(int).astype(str).tolist()
    assert [cells[f"weights-2-{j}"] for j in range(4)] == ["0.0000"] * 4
    np.testing.assert_array_equal(ref["output"][2], 0.0)            # qkv: a query that sees nothing outputs 0
    o.page.get_by_test_id("toggle-causal").check()                  # the causal mask combines with it
    assert_matches_qkv(o, Xr, WQ, WK, WV, mask=mask, causal=True)
    o.check_clean()


def test_cross_attention_from_x_kv(open_page):
    rng = np.random.default_rng(6)
    Xr, Xkv, WQ, WK, WV = (rng.normal(size=s).round(3) for s in ((2, 3), (4, 5), (3, 2), (5, 2), (5, 3)))
    o = open_page({"playground": viz.playground_data(Xr, WQ, WK, WV, X_kv=Xkv, kv_tokens=list("abcd"))})
    assert_matches_qkv(o, Xr, WQ, WK, WV, X_kv=Xkv)
    assert [o.page.get_by_test_id(f"scores-col-{j}").text_content() for j in range(4)] == list("abcd")
    o.fill("X_kv-3-4", "2.5")
    Xkv[3, 4] = 2.5
    assert_matches_qkv(o, Xr, WQ, WK, WV, X_kv=Xkv)
    o.page.get_by_test_id("toggle-causal").check()                  # top-left, as torch's is_causal
    assert_matches_qkv(o, Xr, WQ, WK, WV, X_kv=Xkv, causal=True)
    o.check_clean()


def test_non_numeric_cell_is_flagged_and_the_rest_keeps_working(open_page):
    o = open_page(seed_page())
    o.fill("X-0-0", "abc")
    bad = o.page.get_by_test_id("X-0-0")
    assert bad.get_attribute("aria-invalid") == "true"
    assert "invalid" in bad.get_attribute("class")
    assert "not a number" in o.page.get_by_test_id("status").text_content()
    assert_matches_qkv(o, X, W_Q, W_K, W_V)                        # the last valid value (1.2) still counts
    o.fill("X-1-1", "2")                                            # another cell still works
    X2 = X.copy()
    X2[1, 1] = 2.0
    assert_matches_qkv(o, X2, W_Q, W_K, W_V)
    o.screenshot("invalid-cell")
    o.fill("X-0-0", "0.5")
    assert bad.get_attribute("aria-invalid") is None
    assert o.page.get_by_test_id("status").text_content() == ""
    X2[0, 0] = 0.5
    assert_matches_qkv(o, X2, W_Q, W_K, W_V)
    o.check_clean()


EVIL = ["<img src=x onerror=alert(1)>", "</script><script>alert(2)</script>", "&lt;b&gt; \u2028"]


def test_user_text_is_shown_as_text_and_runs_nothing(open_page):
    data = {"playground": viz.playground_data(X, W_Q, W_K, W_V, tokens=EVIL, title="<svg onload=alert(3)>")}
    o = open_page(data, "escaping")
    assert [o.page.get_by_test_id(f"X-row-{i}").text_content() for i in range(3)] == EVIL
    assert [o.page.get_by_test_id(f"weights-col-{j}").text_content() for j in range(3)] == EVIL
    assert [o.page.get_by_test_id(f"token-{i}").input_value() for i in range(3)] == EVIL
    assert o.page.get_by_test_id("title").text_content() == "<svg onload=alert(3)>"
    assert o.page.title() == "<svg onload=alert(3)>"
    assert o.page.evaluate("document.querySelectorAll('img, main svg, script:not([type])').length") == 1
    # Typing one into a token box is just as harmless.
    o.fill("token-0", "<img src=y onerror=alert(4)>")
    assert o.page.get_by_test_id("weights-row-0").text_content() == "<img src=y onerror=alert(4)>"
    assert o.page.evaluate("document.querySelectorAll('img').length") == 0
    o.page.wait_for_timeout(200)                                    # a dialog would have opened by now
    o.screenshot("escaping")
    o.check_clean()


def test_page_from_the_cli_with_tokens(open_page, tmp_path, browser):
    from qkv.cli import main
    pytest.importorskip("qkv.explain.examples")
    out = tmp_path / "cli.html"
    assert main(["view", "--tokens", "I", "love", "eating", "-o", str(out)]) == 0
    o = Opened(browser, out)
    try:
        assert [o.page.get_by_test_id(f"scores-row-{i}").text_content() for i in range(3)] == ["I", "love", "eating"]
        assert_matches_qkv(o, X, W_Q, W_K, W_V)
        o.check_clean()
    finally:
        o.context.close()


def load_model():
    models = pytest.importorskip("qkv.models")
    try:
        return models.load_bert()
    except ImportError as exc:                                      # the model package is not installed
        pytest.skip(f"no model: {exc}")


@pytest.mark.model
def test_model_view(open_page):
    model = load_model()
    text = "The cat sat on the mat."
    data = viz.model_data(text, model=model)
    o = open_page({"playground": seed_page()["playground"], "model": data}, "model")
    out = model.run([text])
    T = int(np.asarray(out.attention_mask)[0].sum())
    n_layers, n_heads = len(out.attentions), np.asarray(out.attentions[0]).shape[1]
    thumbs = o.page.eval_on_selector_all("[data-testid^='thumb-']", "els => els.map(e => e.dataset.testid)")
    assert len(thumbs) == n_layers * n_heads
    assert o.page.get_by_test_id("model-text").text_content().endswith(text)
    for layer, head in ((0, 0), (n_layers - 1, n_heads - 1), (2, 5 % n_heads)):
        o.page.get_by_test_id(f"thumb-{layer}-{head}").click()
        assert o.page.get_by_test_id("model-selected").text_content() == f"layer {layer}, head {head}"
        want = np.asarray(out.attentions[layer])[0, head, :T, :T]
        assert_displayed(o.cells(), "attn", want)
        weights = o.page.eval_on_selector_all(
            "[data-testid^='line-'][data-weight]",
            "els => Object.fromEntries(els.map(e => [e.dataset.testid, Number(e.dataset.weight)]))")
        assert len(weights) == T * T
        for i in range(T):
            for j in range(T):
                assert abs(weights[f"line-{i}-{j}"] - want[i, j]) <= 1e-6
    assert [o.page.get_by_test_id(f"line-query-{i}").text_content() for i in range(T)] == list(out.tokens[0][:T])
    o.screenshot("model-view")
    o.check_clean()
