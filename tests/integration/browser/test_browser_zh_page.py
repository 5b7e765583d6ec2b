"""The zh page in Chromium has no English left outside what must stay (issue 26): every visible text node and
every aria-label, title and placeholder, with each view present — the playground from a built-in example, a
user's example too large to edit (the canvas view), a model view, a generation and the "Why ÷ √d_k" section —
and every cell's hover line computed. What stays: numbers, formulas and their symbols (Q, K, V, scores, d_k,
softmax, …), names (qkv, RoPE, ALiBi, the models), commands, and the user's own title, tokens and texts."""
from __future__ import annotations

import re

import numpy as np
import pytest

from qkv import viz
from qkv.explain import examples as ex
from qkv.viz import page as vpage
from test_browser_scale import open_file, synthetic_layers
from test_browser_why_flow import KEPT, model_view

pytestmark = pytest.mark.browser

#: Formulas and their symbols, names, commands and settings the zh page keeps as they are (with KEPT, the why
#: section's and the flow's).
SYMBOLS = {"scores", "scaled", "biased", "capped", "masked", "mask", "weights", "weights_h", "output", "final_output",
           "concat", "tanh", "exp", "cos", "sin", "rad", "W_Q", "W_K", "W_V", "W_O", "X_kv", "Q_rot", "K_rot",
           "V_h", "m_h", "RoPE", "ALiBi", "neox", "interleaved", "logit", "CLS", "SEP", "Python", "explain", "FILE", "all-MiniLM-L6-v2",
           "SmolLM2-135M-Instruct"}
#: The user's own words in this test: the large example's title and tokens, the model's text and tokens.
USER = {"notes", "alpha", "beta", "gamma", "the", "cat", "sat", "synthetic", "text"}
ALLOWED = KEPT | SYMBOLS | USER
#: The tables whose caption names a step of attention: the zh caption says it in Chinese.
STEP_TABLES = ("scores", "scaled", "biased", "capped", "mask", "weights", "output")
#: A word: letters, digits and underscores from a letter on, joined by hyphens (SmolLM2-135M-Instruct).
WORD = r"[A-Za-z][A-Za-z_0-9]*(?:-[A-Za-z0-9]+)*"

#: Every visible text node (the page's <title> too), and every aria-label, title and placeholder (hidden ones too),
#: after each cell's hover line is computed (the lines are made, and set as the cell's title, on first hover).
READ = """() => {
  document.querySelectorAll("td[tabindex]").forEach(td => td.dispatchEvent(new MouseEvent("mouseenter")));
  const texts = [document.title], attrs = [];
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    const p = n.parentElement;
    if (!n.textContent.trim() || p.closest("script, style") || !p.checkVisibility()) continue;
    texts.push(n.textContent);
  }
  document.querySelectorAll("[aria-label], [title], [placeholder]").forEach(e => {
    ["aria-label", "title", "placeholder"].forEach(a => { if (e.hasAttribute(a)) attrs.push(e.getAttribute(a)); });
  });
  const captions = {};
  document.querySelectorAll("table[data-matrix]").forEach(t => {
    captions[t.dataset.matrix] = t.querySelector("caption").firstChild.textContent;
  });
  return {texts, attrs, captions};
}"""


def english(strings) -> list[str]:
    """The English words left (three letters or more, outside ALLOWED; qkv's Python names such as
    qkv.viz.rollout and a head's kind label such as P99 aside), each once."""
    text = re.sub(r"\bqkv(?:\.\w+)+|\b[A-Za-z]\d+\b", " ", " ".join(strings))
    words = re.findall(WORD, text)
    out = []
    for w in words:
        parts = [p for p in re.split(r"[-_]", w) if len(p) >= 3 and not p.isdigit()]
        if w not in ALLOWED and any(p not in ALLOWED for p in parts) and w not in out:
            out.append(w)
    return out


def read(o) -> dict:
    got = o.page.evaluate(READ)
    return {"words": english(got["texts"] + got["attrs"]), "captions": got["captions"]}


def generation_view(T: int, P: int, L: int, H: int) -> dict:
    """A generation's value without a model: the rows of a causal synthetic sequence's generated tokens."""
    layers = synthetic_layers(T, L, H, seed=3)
    rows = [np.concatenate([a[:, P + s, :P + s + 1] for a in layers]) for s in range(T - P)]
    steps = vpage.MapSet(thumbs=False, what="synthetic")
    steps.add_group(rows, label="synthetic")
    tokens = ["the", " cat", " sat"] + [f" 词{i}" for i in range(T - 3)]
    return {"name": "SmolLM2-135M-Instruct", "prompt": "the cat sat", "chat": False, "text": "".join(tokens[P:]),
            "finish": "eos", "tokens": tokens, "prompt_len": P, "layers": L, "heads": H, "digits": vpage.MAP_DIGITS,
            "steps": steps.to_json()}


def test_the_zh_page_with_every_view_has_no_english_left(browser, tmp_path):
    T = 150
    large = {"title": "my notes", "tokens": ["alpha", "beta", "gamma"] * (T // 3), "Q": [[1.0, 0.5]] * T,
             "K": [[1.0, -0.5]] * T}
    layers = synthetic_layers(8, 2, 2, seed=6)
    data = {"playground": viz.from_worked(ex.load_example("two_head")),
            "example": viz.worked_data(ex.from_dict(large)),
            "model": model_view(layers, [f"词{i}" for i in range(8)]),   # lines, table, kinds, rollout, flow
            "generation": generation_view(9, 3, 2, 2), "why": viz.why_data(seed=0, samples=256)}
    o = open_file(browser, viz.write_page(tmp_path / "zh.html", data, lang="zh"))
    try:
        p = o.page
        shown = {t: p.get_by_test_id(t).is_visible() for t in ("playground", "example-view", "model-view",
                                                               "generation-view", "why")}
        assert all(shown.values()), shown
        assert p.get_by_test_id("flow-title").is_visible()
        p.get_by_test_id("thumb-1-1").click()
        p.get_by_test_id("gen-next").click()
        got = read(o)
        assert got["words"] == [], got["words"]
        p.get_by_test_id("toggle-causal").check()                     # the mask (its ✗ cells) …
        p.locator("#heads-select").select_option("1")                 # … and one head: the plain output caption
        got = read(o)
        assert got["words"] == [], got["words"]
        assert all(re.search(r"[\u4e00-\u9fff]", got["captions"][k]) for k in ("scores", "scaled", "mask", "weights",
                                                                             "output")), got["captions"]
        assert p.locator("#title").text_content() == p.title()         # the built-in's title, in Chinese
        assert re.search(r"[\u4e00-\u9fff]", p.title()) and not english([p.title()])
        assert "my notes" in p.locator("#example").text_content()     # the user's title as they wrote it
        o.check_clean()
    finally:
        o.context.close()


@pytest.mark.parametrize("name", ex.builtin_names())
def test_every_builtin_example_in_zh(browser, tmp_path, name):
    """Each built-in's title and its playground (RoPE, ALiBi, soft-capping, sinks, cross-attention, …) in zh."""
    w = ex.load_example(name)
    o = open_file(browser, viz.write_page(tmp_path / f"{name}.html", {"playground": viz.from_worked(w)}, lang="zh"))
    try:
        got = read(o)
        tokens = set(re.findall(WORD, " ".join(list(w.tokens) + list(w.kv_tokens or []))))
        assert [x for x in got["words"] if x not in tokens] == [], got["words"]
        steps = [k for k in STEP_TABLES if k in got["captions"]]
        assert steps and all(re.search(r"[\u4e00-\u9fff]", got["captions"][k]) for k in steps), got["captions"]
        o.check_clean()
    finally:
        o.context.close()
