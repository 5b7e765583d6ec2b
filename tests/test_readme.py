"""The README's examples run: the Python blocks of the core section, and the Quick start stays two commands."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _section(name: str) -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"<!-- BEGIN section:{name} -->(.*?)<!-- END section:{name} -->", text, re.S)
    assert m, f"README has no section {name}"
    return m.group(1)


def test_core_section_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", _section("core"), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "['X', 'Q', 'K', 'V', 'scores', 'scaled', 'weights', 'output']" in out
    assert "[0.0299 0.0071 0.963 ]" in out
    assert "◩ · ◩ ◩ ·" in out                   # the flex block's StreamingLLM block mask (its row 3)


def test_quick_start_is_exactly_two_commands():
    text = README.read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make demo", "make test"]
