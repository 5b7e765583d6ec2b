"""The page's attention flow and its "Why ÷ √d_k" section, without a browser: the embedded numbers are exactly
what qkv's own functions return (qkv.viz.attention_flow, qkv.lab.scale, qkv.lab.paragraph), the flow's size
limit is said with its numbers, bad input is refused, and every new word has a Chinese twin with no English
left. The browser side: tests/integration/browser/test_browser_why_flow.py."""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

import qkv
from qkv import lab, viz
from qkv.locales import strings
from qkv.viz import heads as vheads
from qkv.viz import page as vpage


def embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def attention_like(T: int, L: int, H: int, *, causal: bool, seed: int = 0) -> list[np.ndarray]:
    """L layers of (H, T, T) float32 softmax rows (causal: j ≤ i), with a previous-token head."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(L):
        x = rng.standard_normal((H, T, T)) * 1.5
        x[0, np.arange(1, T), np.arange(T - 1)] += 5.0
        if causal:
            x = np.where(np.tri(T, dtype=bool), x, -np.inf)
        e = np.exp(x - x.max(-1, keepdims=True))
        out.append((e / e.sum(-1, keepdims=True)).astype(np.float32))
    return out


def model_view(layers, tokens, causal):
    L, H, T = len(layers), layers[0].shape[0], layers[0].shape[-1]
    data = vpage._layers_data(layers, L, H, T, causal, what="synthetic", tokens=tokens)
    data.update({"kind": "model", "name": "synthetic", "text": "a synthetic text", "tokens": tokens,
                 "decoder": causal, "kv_heads": H})
    return data


# ----------------------------------------------------------------------------------------------- flow
@pytest.mark.parametrize("causal", [False, True])
def test_the_embedded_flow_is_qkv_viz_attention_flow(causal):
    T, L, H = 10, 3, 4
    layers = attention_like(T, L, H, causal=causal, seed=1)
    data = model_view(layers, [f"w{i}" for i in range(T)], causal)
    assert data["flow_limit"] is None
    F = viz.attention_flow(layers)
    (got,) = vpage.decode_maps(data["flow"])
    np.testing.assert_array_equal(got, vpage.quantize(np.clip(F, 0.0, 1.0)))        # k/1000, Python's rounding
    assert data["flow"]["causal"] == [causal] and data["flow"]["shapes"] == [[T, T]]
    if causal:
        assert not np.any(np.triu(F, 1))                                             # nothing flows forwards
    # and it survives the page: the data page.js reads is that map
    page = embedded(viz.render_page({"model": data}))["model"]
    assert page["flow"] == data["flow"] and page["flow_limit"] is None


def test_the_flow_limit_is_measured_work_and_said_with_its_numbers(monkeypatch):
    # the constant: MiniLM's 6 layers up to 12 tokens, SmolLM2's 30 up to 8 (measured, see PAGE_FLOW_WORK)
    assert vpage.flow_limit(6) == 12 and vpage.flow_limit(30) == 8
    for L in (1, 6, 30):
        n = vpage.flow_limit(L)
        assert vheads.flow_work(L, n) <= vpage.PAGE_FLOW_WORK < vheads.flow_work(L, n + 1)
    T, L, H = 12, 3, 2
    layers = attention_like(T, L, H, causal=False)
    monkeypatch.setattr(vpage, "PAGE_FLOW_WORK", vheads.flow_work(L, T) - 1)       # one token over
    data = model_view(layers, [f"w{i}" for i in range(T)], False)
    assert data["flow"] is None and data["rollout"] is not None
    assert data["flow_limit"] == {"reason": "size", "limit": T - 1, "layers": L}
    en = strings("en", "page.")["page.flow_too_big"].format(limit=T - 1, layers=L, tokens=T)
    assert f"up to {T - 1} tokens through {L} layers" in en and f"this one has {T}" in en


def test_flow_without_networkx_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "networkx", None)                             # import networkx fails
    data = model_view(attention_like(5, 2, 2, causal=False), list("abcde"), False)
    assert data["flow"] is None and data["flow_limit"] == {"reason": "networkx", "limit": vpage.flow_limit(2),
                                                         "layers": 2}


def test_no_flow_without_tokens_or_for_cross_attention():
    layers = attention_like(6, 2, 2, causal=False)
    data = vpage._layers_data(layers, 2, 2, 6, False, what="example")                 # a worked example's heads
    assert data["flow"] is None and data["flow_limit"] is None and data["rollout"] is None


# ----------------------------------------------------------------------------------------------- why
@pytest.fixture(scope="module")
def why():
    return viz.why_data(seed=3, samples=512)


def test_the_embedded_scale_rows_are_qkv_lab_scale(why):
    assert why["scale"] == lab.scale(seed=3, samples=512)
    assert why["seed"] == 3 and why["samples"] == 512
    data = embedded(viz.render_page({"why": why}))["why"]
    assert data["scale"] == lab.scale(seed=3, samples=512)                          # through JSON, bit for bit
    assert data["examples"] == why["examples"]
    assert [r["d_k"] for r in data["scale"]["rows"]] == list(lab._scale.D_KS)


def test_the_embedded_paragraph_is_the_labs_in_the_pages_language(why):
    for lang in ("en", "zh"):
        data = embedded(viz.render_page({"why": why}, lang=lang))
        assert data["why"]["paragraph"] == lab.paragraph("scale", why["scale"], lang)
        assert data["why"]["strings"]["lab.col_max_weight"] == strings(lang, "lab.")["lab.col_max_weight"]
        assert data["strings"] == strings(lang, "page.")
    assert "每个 d_k 取 512 行" in embedded(viz.render_page({"why": why}, lang="zh"))["why"]["paragraph"]


def test_the_sampled_rows_are_qkvs_forward_with_and_without_scaling(why):
    keys = why["scale"]["settings"]["keys"]
    for ex in why["examples"]:
        d = ex["d_k"]
        s, ss = np.array(ex["scores"]), np.array(ex["scaled"])
        w, ws = np.array(ex["weights"]), np.array(ex["weights_scaled"])
        assert s.shape == ss.shape == w.shape == ws.shape == (keys,)
        np.testing.assert_allclose(ss, s / np.sqrt(d), rtol=1e-12)                # the ÷ √d_k step
        np.testing.assert_allclose(w.sum(), 1.0) and np.testing.assert_allclose(ws.sum(), 1.0)
        np.testing.assert_allclose(ws, qkv.stages.softmax(ss), rtol=1e-12)
        assert np.argmax(w) == np.argmax(ws)                                        # same order, flatter
    first, last = why["examples"][0], why["examples"][-1]
    assert max(last["weights"]) > 0.99 and max(last["weights_scaled"]) < 0.6       # d_k = 1024: one-hot unscaled
    assert max(first["weights"]) < 0.9


def test_why_data_and_the_page_refuse_bad_input():
    with pytest.raises(ValueError, match="seed"):
        viz.why_data(seed=-1)
    with pytest.raises(ValueError, match="samples"):
        viz.why_data(samples=0)
    with pytest.raises(ValueError, match="why: expected why_data"):
        viz.render_page({"why": {"scale": {"rows": []}}})
    with pytest.raises(ValueError, match="why: expected why_data"):
        viz.render_page({"why": {"scale": lab.scale(samples=16, d_ks=[4]), "examples": []}})


def test_qkv_view_has_the_why_section_unless_told_not_to(tmp_path, capsys):
    from qkv.cli import main

    out = tmp_path / "v.html"
    assert main(["view", "-o", str(out)]) == 0
    data = embedded(out.read_text(encoding="utf-8"))
    assert data["playground"] and data["why"]["scale"] == lab.scale(seed=0, samples=vpage.WHY_SAMPLES)
    assert main(["view", "--no-why", "-o", str(out)]) == 0
    assert embedded(out.read_text(encoding="utf-8"))["why"] is None
    capsys.readouterr()


# ----------------------------------------------------------------------------------------------- words
NEW_KEYS = [k for k in strings("en", "page.") if k.startswith(("page.flow_", "page.why_"))]
#: Names and terms the zh strings keep as they are (code, commands, the seeds' own q·k / key / query).
KEPT = {"qkv", "lab", "scale", "seed", "samples", "viz", "attention_flow", "attentions", "queries", "networkx",
        "pip", "install", "Abnar", "Zuidema", "rollout", "query", "key", "softmax", "nat", "d_k"}


def english_words(text: str) -> list[str]:
    text = re.sub(r"\{\w+\}", "", text)                                         # placeholders are filled in
    return [w for w in re.findall(r"[A-Za-z][A-Za-z_]{2,}", text) if w not in KEPT]


def test_every_new_word_is_in_both_languages_and_zh_has_no_english():
    en, zh = strings("en", "page."), strings("zh", "page.")
    assert len(NEW_KEYS) == 15
    for k in NEW_KEYS:
        assert k in zh and (zh[k] != en[k] or k == "page.why_dk"), k
        assert english_words(zh[k]) == [], (k, english_words(zh[k]))
    lab_zh = strings("zh", "lab.")
    for k in ("lab.unscaled", "lab.scaled", "lab.col_var", "lab.col_max_weight", "lab.col_entropy", "lab.col_grad"):
        assert english_words(lab_zh[k]) == [], k
