"""The titles qkv gives on the page follow its language (issue 26): a built-in example's title (qkv/locales,
explain.example_<name>) and the playground's default; a title the user wrote stays as written in every language,
and the English page keeps the titles it had."""
from __future__ import annotations

import json
import re

import pytest

from qkv import locales, viz
from qkv.explain import examples as ex


def embedded(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)[1])


def tab_title(page: str) -> str:
    return re.search(r"<title>(.*?)</title>", page)[1]


def test_every_builtin_has_a_title_in_every_language_and_the_english_one_is_its_files():
    assert set(ex.TITLE_KEYS) == set(ex.builtin_names())
    for name in ex.builtin_names():
        w = ex.load_example(name)
        titles = ex.titles(w)
        assert titles["en"] == w.title == locales.t(ex.TITLE_KEYS[name], "en")      # the YAML file's title
        assert re.search(r"[\u4e00-\u9fff]", titles["zh"]) and titles["zh"] != titles["en"]


def test_a_builtin_title_on_the_zh_page_and_the_english_page_unchanged():
    d = viz.from_worked(ex.load_example("seed003"))
    zh, en = viz.render_page({"playground": d}, lang="zh"), viz.render_page({"playground": d})
    assert embedded(zh)["playground"]["title"] == tab_title(zh) == "种子 003 · 我 爱 吃（自注意力，单头）"
    assert embedded(en)["playground"]["title"] == tab_title(en) == "Seed 003 · 我 爱 吃 (self-attention, one head)"


@pytest.mark.parametrize("change", ["title", "file"])
def test_a_users_own_title_stays_as_written(tmp_path, change):
    if change == "title":                                   # a built-in whose title the user set
        w = ex.load_example("seed003")
        w.title = "my own title"
    else:                                                   # a file named like a built-in, with its own title
        path = tmp_path / "seed003.yaml"
        path.write_text('title: "my own title"\nQ: [[1, 0]]\nK: [[1, 0]]\n', encoding="utf-8")
        w = ex.load_file(path)
    assert ex.titles(w) is None
    d = viz.from_worked(w)
    for lang in ("en", "zh"):
        page = viz.render_page({"playground": d}, lang=lang)
        assert embedded(page)["playground"]["title"] == tab_title(page) == "my own title"


def test_the_default_playground_title_and_the_tab_title_follow_the_language():
    import numpy as np

    d = viz.playground_data(Q=np.eye(2), K=np.eye(2))
    assert d["title"] == "Attention playground"
    assert embedded(viz.render_page({"playground": d}, lang="zh"))["playground"]["title"] == "注意力演练场"
    assert embedded(viz.render_page({"playground": d}))["playground"]["title"] == "Attention playground"
    notice = {"notices": [{"key": "page.playground", "args": {}}]}            # no view: the page's own title
    assert tab_title(viz.render_page(notice)) == "qkv attention"
    assert tab_title(viz.render_page(notice, lang="zh")) == "qkv 注意力"
