"""The tests of tests/unit/test_cli_counts.py that need the llama extra (gguf, jinja2) or SmolLM2."""
import re

import pytest

pytest.importorskip("click")

from test_cli_counts import run_cli  # noqa: E402,F401  (its helpers, shared)


def test_generate_states_its_bounds_in_help(capsys):
    pytest.importorskip("jinja2")
    rc, out, _ = run_cli(capsys, "generate", "--help")
    text = " ".join(out.split())
    assert "8,192 tokens in all for SmolLM2" in text and "49,152 for SmolLM2" in text


def test_generate_top_k_beyond_the_vocabulary_names_it(tmp_path, capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from test_llama import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    rc, out, err = run_cli(capsys, "generate", "hi", "--top-k", 10**9, "--temperature", 1, "--gguf", path)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert re.search(r"--top-k: expected 1 … \d+ \(the vocabulary\), got 1000000000", err), err
