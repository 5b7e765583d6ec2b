"""qkv.locales: every user-facing string as data, one JSON file per language.

- en.json and zh.json have the same keys with the same {placeholders};
- every key is used by the code or the page (no dead strings), and every key the code asks for exists;
- adding a language is adding one file (QKV_LOCALES or add_dir), and the CLI offers it;
- the checker's verdict words, the CLI's own error lines and the page's words follow the language.
"""
import json
import re
import shutil
from pathlib import Path

import pytest

from qkv import locales
from qkv.cli import main
from qkv.explain import check, examples as ex, render

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "qkv"
LOCALES = SRC / "locales"


def load(code):
    return json.loads((LOCALES / f"{code}.json").read_text(encoding="utf-8"))


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_builtin_languages():
    assert locales.langs()[:2] == ("en", "zh")
    assert sorted(p.stem for p in LOCALES.glob("*.json")) == ["en", "zh"]


def test_en_and_zh_have_the_same_keys_and_placeholders():
    en, zh = load("en"), load("zh")
    assert set(en) == set(zh), (set(en) ^ set(zh))
    for key in en:
        assert locales.placeholders(en[key]) == locales.placeholders(zh[key]), key
        assert zh[key].strip(), key


def _sources() -> str:
    files = [p for p in SRC.rglob("*.py")] + [SRC / "viz" / "page" / "page.js"]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_every_key_is_used_and_every_used_key_exists():
    text = _sources()
    en = load("en")
    unused = [k for k in en if not re.search(r"""["']%s["']""" % re.escape(k), text)]
    assert unused == []
    # every key-like literal in the code ("explain.…", "page.…", …) is in en.json (file names aside)
    asked = set(re.findall(r"""["']((?:%s)\.[A-Za-z_0-9]+)["']""" % "|".join(NAMESPACES), text))
    asked -= {"page.js", "page.css", "model.safetensors"}
    assert len(asked) > 100 and asked <= set(en), asked - set(en)


#: every key is "<namespace>.<name>": the explainer, the checker, the CLI's own words, the model commands, the page,
#: the lab's experiments and the ring's trace
NAMESPACES = ("explain", "check", "cli", "model", "page", "lab", "ring")


def test_namespaces():
    assert {k.split(".")[0] for k in load("en")} <= set(NAMESPACES)


def test_t_formats_and_falls_back():
    assert locales.t("explain.step", "en", n=3) == "Step 3"
    assert locales.t("explain.step", "zh", n=3) == "步骤3"
    assert locales.t("explain.doc_title") == "Scaled dot-product attention, step by step"
    with pytest.raises(ValueError, match="lang: expected one of en, zh"):
        locales.t("explain.step", "fr", n=1)
    with pytest.raises(KeyError, match="no.such"):
        locales.t("no.such", "en")
    assert locales.strings("zh", "page.")["page.reset"] == "重置"
    assert all(k.startswith("page.") for k in locales.strings("en", "page."))


@pytest.fixture
def xx(tmp_path, monkeypatch):
    """A new language: en.json copied as xx.json (a few values marked), found through QKV_LOCALES."""
    d = tmp_path / "my_locales"
    d.mkdir()
    data = load("en")
    data["explain.doc_title"] = "XX: attention, step by step"
    data["check.status_wrong"] = "xx-wrong"
    data["cli.unknown_example"] = "xx: no example {name!r} ({names})"
    data["page.reset"] = "xx-reset"
    del data["explain.overview"]                               # missing keys fall back to English
    (d / "xx.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    monkeypatch.setenv("QKV_LOCALES", str(d))
    return d


def test_adding_a_language_is_adding_one_file(xx, capsys):
    assert "xx" in locales.langs() and locales.check_lang("xx") == "xx"
    w = ex.load_example("seed003")
    s = render(ex.run(w), lang="xx", tokens=w.tokens)
    assert s.startswith("XX: attention, step by step") and "softmax(Q·Kᵀ / √d_k) · V" in s
    assert "Q[我, 0] = 1.2×0.1 + 0.8×0.4 + (−0.5)×0.7 + 0.3×1.0 = 0.39" in s
    assert "xx-wrong" in check(w).render(lang="xx")
    rc, out, _ = run_cli(capsys, "explain", "--lang", "xx")
    assert rc == 0 and out.startswith("Seed 003")
    rc, out, err = run_cli(capsys, "explain", "--lang", "xx", "-e", "nope")
    assert rc == 2 and err.startswith("qkv: error: xx: no example 'nope'") and err.count("\n") == 1
    rc, out, _ = run_cli(capsys, "check", "--example", "seed003", "--lang", "xx")
    assert rc == 1 and "xx-wrong" in out
    from qkv import viz
    page = viz.render_page({"playground": viz.from_worked(w)}, lang="xx")
    assert '"page.reset":"xx-reset"' in page and '"lang":"xx"' in page


def test_add_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("QKV_LOCALES", raising=False)
    monkeypatch.setattr(locales, "_ADDED", [])
    d = tmp_path / "more"
    d.mkdir()
    shutil.copy(LOCALES / "zh.json", d / "zh-TW.json")
    assert "zh-TW" not in locales.langs()
    locales.add_dir(d)
    assert "zh-TW" in locales.langs() and locales.t("check.c_ok", "zh-TW") == "所有声称的数都正确。"
    with pytest.raises(ValueError, match="folder"):
        locales.add_dir(tmp_path / "none")


def test_a_broken_locale_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "yy.json").write_text('["not", "an", "object"]', encoding="utf-8")
    monkeypatch.setenv("QKV_LOCALES", str(tmp_path))
    with pytest.raises(ValueError, match="yy.json: expected a JSON object"):
        locales.t("explain.step", "yy", n=1)


def test_unknown_language_on_the_command_line(capsys):
    rc, out, err = run_cli(capsys, "explain", "--lang", "fr")
    assert rc == 2 and out == "" and "'fr' is not one of 'en', 'zh'" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------- zh everywhere
def test_verdict_words_are_translated_in_the_text_report_not_in_json(capsys):
    rc, out, _ = run_cli(capsys, "check", "--example", "seed003", "--lang", "zh")
    assert rc == 1
    assert "根源错误（错误：" in out and "被继承的错误（继承错误：" in out
    assert "wrong" not in out and "carried" not in out
    rc, out, _ = run_cli(capsys, "check", "--example", "seed003", "--lang", "zh", "--format", "json")
    assert {c["status"] for c in json.loads(out)["claims"]} == {"correct", "carried", "wrong"}
    rc, out, _ = run_cli(capsys, "check", "--example", "seed003")
    assert "Root mistakes (wrong: " in out and "Carried into (carried: " in out


def test_cli_messages_in_chinese(capsys):
    rc, _, err = run_cli(capsys, "explain", "--lang", "zh", "-e", "nope")
    assert rc == 2 and "--example：没有内置示例 'nope'" in err
    rc, _, err = run_cli(capsys, "explain", "--lang", "zh", "--query", "猫")
    assert rc == 2 and "--query：应为" in err
    rc, _, err = run_cli(capsys, "check", "--lang", "zh")
    assert rc == 2 and "需要给出要检查的 FILE" in err
    rc, out, _ = run_cli(capsys, "examples", "--lang", "zh")
    assert rc == 0 and "（默认）" in out.splitlines()[0] and "因果掩码" in out


def test_markdown_shape_label_follows_the_language():
    t = ex.run(ex.load_example("seed003"))
    assert "Shape: `(3, 4)`" in render(t, fmt="markdown")
    assert "形状: `(3, 4)`" in render(t, fmt="markdown", lang="zh")


def test_the_page_embeds_its_language():
    from qkv import viz

    data = {"playground": viz.from_worked(ex.load_example("seed003"))}
    en, zh = viz.render_page(data), viz.render_page(data, lang="zh")
    assert '"lang":"en"' in en and '"page.reset":"reset"' in en
    assert '"lang":"zh"' in zh and '"page.reset":"重置"' in zh
    assert viz.render_page(dict(data, lang="zh")) == zh
    with pytest.raises(ValueError, match="lang"):
        viz.render_page(data, lang="fr")
