"""write_page checks what it is given against each view's shape (issue 26), and every *_data function returns
the value of one key of the page's data: {"playground": playground_data(…), "example": worked_data(…),
"model": model_data(…), "generation": generation_data(…), "why": why_data()}."""
import numpy as np
import pytest

from qkv import viz
from qkv.explain import examples as ex

X = np.array([[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]])
W = np.arange(12.0).reshape(4, 3) / 10


@pytest.mark.parametrize("data, error, pattern", [
    ({"model": {"x": 1}}, ValueError,
     r"^model: expected model_data\(\)'s dict \(with kind, name, layers, heads, T, maps, tokens\), "
     r"got a dict with keys \[x\]$"),
    ({"playground": [1, 2]}, ValueError, r"^playground: expected playground_data\(\)'s, from_worked\(\)'s or "
                                         r"worked_data\(\)'s dict .*, got list \[1, 2\]$"),
    ({"generation": {"generation": {}, "model": {}}}, ValueError, r"^generation: expected generation_data\(\)'s dict"),
    ({"example": {"kind": "model"}}, ValueError, r"^example: expected worked_data\(\)'s dict"),
    ({"why": {"scale": {}}}, ValueError, r"^why: expected why_data\(\)'s dict"),
    ({"notices": ["hello"]}, ValueError, r"^notices: expected a list of \{'key': 'page.…'"),
    ({"playgrond": 1}, ValueError, r"^data: unknown key 'playgrond'; expected playground, model, example"),
    ({"model": None}, ValueError, r"^data: expected a dict with at least one of"),
    ("<html>", TypeError, r"^data: expected a dict of the page's views"),
])
def test_write_page_refuses_what_no_view_reads(tmp_path, data, error, pattern):
    path = tmp_path / "p.html"
    with pytest.raises(error, match=pattern) as e:
        viz.write_page(path, data)
    assert len(str(e.value)) < 200
    assert list(tmp_path.iterdir()) == []                                   # nothing written


def test_a_view_of_the_wrong_shape_names_what_is_off(tmp_path):
    pg = viz.playground_data(X, W, W, W)
    with pytest.raises(ValueError, match=r"^playground: .*\(start: one of X, QK, scores; heads ≥ 1\)"):
        viz.render_page({"playground": dict(pg, start="Y")})
    with pytest.raises(ValueError, match=r"\(tokens: a list of strings\)"):
        viz.render_page({"playground": dict(pg, tokens=[1, 2, 3])})
    big = viz.worked_data(ex.from_dict({"tokens": [f"t{i}" for i in range(150)], "Q": [[1.0]] * 150,
                                        "K": [[1.0]] * 150}))
    assert big["kind"] == "example"
    with pytest.raises(ValueError, match=r"^example: .*\(layers × heads coded maps of T tokens\)"):
        viz.render_page({"example": dict(big, T=149)})
    with pytest.raises(ValueError, match=r"^model: .*\(kind 'model', not 'example'\)"):
        viz.render_page({"model": big})                                     # an example's view is not a model's
    with pytest.raises(ValueError, match="worked_data\\(\\) gave the playground, and playground is given too"):
        viz.render_page({"example": viz.worked_data(ex.load_example("seed003")), "playground": pg})


def test_each_data_function_is_the_value_of_its_key():
    small = viz.worked_data(ex.load_example("seed003"))
    why = viz.why_data(samples=256)
    html = viz.render_page({"playground": viz.from_worked(ex.load_example("two_head")), "why": why})
    assert "qkv-data" in html
    html = viz.render_page({"example": small, "why": why})                  # the small example: the playground
    assert '"title":"' in html


class _FakeDecoder:
    """Just enough of a decoder for generation_data: two layers of two heads over five tokens."""

    class config:
        num_layers, num_heads, num_kv_heads, name, path = 2, 2, 1, "fake", ""

    def generate(self, prompt, max_new_tokens=32, chat=False, **kw):
        from types import SimpleNamespace
        return SimpleNamespace(prompt_ids=[1, 2, 3], ids=[4, 5], prompt=prompt, text=" ab", finish_reason="length")

    def token_texts(self, ids):
        return [f"t{i}" for i in ids]


def test_generation_data_under_generation_carries_its_model_view(monkeypatch):
    from qkv.viz import page as vpage

    def fake_layers(model, ids):
        T = len(ids)
        w = np.tril(np.ones((T, T), np.float32))
        w /= w.sum(-1, keepdims=True)
        for _ in range(2):
            yield np.stack([w, w])

    monkeypatch.setattr(vpage, "decoder_attentions", fake_layers)
    gen = viz.generation_data(_FakeDecoder(), "hi", max_new_tokens=2)
    assert set(gen) >= {"name", "prompt", "steps", "model"} and "generation" not in gen
    html = viz.render_page({"generation": gen})
    import json
    import re
    page = json.loads(re.search(r'id="qkv-data">(.*?)</script>', html, re.S).group(1))
    assert page["generation"]["prompt_len"] == 3 and "model" not in page["generation"]
    assert page["model"]["kind"] == "model" and page["model"]["T"] == 5      # the sequence's model view
