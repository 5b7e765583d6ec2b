"""`--model` means one thing in every command (issue 26): it names the model — minilm or smollm2 — and a model
name is never taken as text; the text comes from the command's own argument or --text. A name that is no model,
or a model the command cannot use, is one line on stderr, exit 2, before any model is loaded."""
import re

import pytest

pytest.importorskip("click")

from qkv.cli import main  # noqa: E402


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc, err, pattern):
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(pattern, err), err


@pytest.mark.parametrize("args, pattern", [
    # a model name alone: before, both drew MiniLM's attention over the word "smollm2"
    (["view", "--model", "smollm2", "-o", "{tmp}/v.html"], r"--model smollm2: give the text with --text TEXT or "
                                                           r"--generate PROMPT$"),
    (["heatmap", "--model", "smollm2", "-o", "{tmp}/h.png"], r"--model smollm2: give the text with --text TEXT$"),
    (["view", "--model", "MiniLM", "-o", "{tmp}/v.html"], r"--model minilm: give the text with --text TEXT$"),
    # a text where the model's name goes: said so, cut short, pointing at --text
    (["heatmap", "--model", "The cat sat on the mat and then it looked at the birds.", "-o", "{tmp}/h.png"],
     r"--model: expected a model name \(minilm or smollm2\), got 'The cat sat on the mat and then it look…'; "
     r"the text goes in --text TEXT$"),
    (["view", "--model", "The cat sat.", "-o", "{tmp}/v.html"], r"got 'The cat sat.'; the text goes in --text TEXT"),
    (["model", "hi", "--model", "gpt2"], r"--model: expected a model name \(minilm or smollm2\), got 'gpt2'$"),
    (["generate", "hi", "--model", "bert"], r"--model: expected a model name \(minilm or smollm2\), got 'bert'$"),
    # a model the command cannot use
    (["generate", "hi", "--model", "minilm"], r"--model: qkv generate works with smollm2, not minilm$"),
    (["view", "--model", "minilm", "--generate", "hi", "-o", "{tmp}/v.html"], r"--generate: needs a decoder"),
    (["heatmap", "--text", "hi", "--example", "seed003", "-o", "{tmp}/h.png"], r"not both"),
])
def test_model_names_a_model_never_the_text(tmp_path, capsys, args, pattern):
    rc, out, err = run_cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    one_line(rc, err, pattern)
    assert list(tmp_path.iterdir()) == []                                   # nothing written


def test_the_messages_follow_lang(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "view", "--model", "smollm2", "--lang", "zh", "-o", tmp_path / "v.html")
    one_line(rc, err, r"--model smollm2：请用 --text TEXT 给出文本，或用 --generate PROMPT 给出提示")
    rc, _, err = run_cli(capsys, "model", "hi", "--model", "gpt2", "--lang", "zh")
    one_line(rc, err, r"--model：应为模型名称（minilm 或 smollm2），实际为 'gpt2'")


def test_every_command_documents_model_as_a_name(capsys):
    for cmd in ("model", "heatmap", "view", "generate"):
        assert main([cmd, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert re.search(r"-m, --model (minilm\|smollm2|smollm2)\b", out), (cmd, out)
