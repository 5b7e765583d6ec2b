"""Each *_data function's value under its own key makes a page that runs (issue 26): before, generation_data
and worked_data returned the outer dict, so write_page(p, {"generation": generation_data(m, "hi")}) wrote a page
whose script failed."""
from __future__ import annotations

import pytest

from qkv import viz
from qkv.explain import examples as ex
from test_browser_page import Opened

pytestmark = pytest.mark.browser


def _views(o: Opened) -> dict:
    return {t: o.page.get_by_test_id(t).is_visible() for t in ("playground", "generation-view", "model-view",
                                                                "example-view")}


def test_a_large_worked_example_under_example(browser, tmp_path):
    doc = {"title": "large", "tokens": [f"t{i}" for i in range(150)], "Q": [[1.0, 0.5]] * 150,
           "K": [[1.0, -0.5]] * 150}
    path = viz.write_page(tmp_path / "ex.html", {"example": viz.worked_data(ex.from_dict(doc))})
    o = Opened(browser, path)
    try:
        assert _views(o) == {"playground": False, "generation-view": False, "model-view": False,
                             "example-view": True}
        assert "cells" in o.page.get_by_test_id("notice-0").text_content()
        o.check_clean()
    finally:
        o.context.close()


@pytest.mark.model
def test_generation_data_under_generation_runs(browser, tmp_path):
    models = pytest.importorskip("qkv.models")
    try:
        model = models.load_llama()
    except ImportError as exc:
        pytest.skip(f"no SmolLM2: {exc}")
    gen = viz.generation_data(model, "hi", max_new_tokens=3)
    path = viz.write_page(tmp_path / "gen.html", {"generation": gen,
                                                  "example": viz.worked_data(ex.load_example("seed003"))})
    o = Opened(browser, path)
    try:
        assert _views(o) == {"playground": True, "generation-view": True, "model-view": True,
                             "example-view": False}
        assert o.page.get_by_test_id("gen-text").text_content().endswith(gen["text"])
        assert "SmolLM2-135M-Instruct" in o.page.locator("#generation").text_content()
        o.page.get_by_test_id("gen-next").click()
        o.check_clean()
    finally:
        o.context.close()
