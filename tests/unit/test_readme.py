"""The README's examples run: every ```python block, in order, in one fresh namespace; the Quick start stays two
commands; the README stays a front door (≤ 400 lines) whose links into docs/ resolve."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "readme"}
    for i, code in enumerate(blocks, 1):
        exec(compile(code, f"README.md (python block {i})", "exec"), ns)
    out = capsys.readouterr().out
    assert "['X', 'Q', 'K', 'V', 'scores', 'scaled', 'weights', 'output']" in out
    assert "[0.0299 0.0071 0.963 ]" in out
    assert "◩ · ◩ ◩ ·" in out                   # the flex block's StreamingLLM block mask (its row 3)


def test_quick_start_is_exactly_two_commands():
    text = README.read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    links = re.findall(r"\]\(((?:docs|benchmarks)/[^)#]*)", text)
    assert any(link.startswith("docs/") for link in links) and "benchmarks/RESULTS.md" in links
    for link in links:
        assert (ROOT / link).exists(), link
