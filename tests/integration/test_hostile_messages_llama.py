"""The tests of tests/unit/test_hostile_messages.py that need the llama extra (gguf, jinja2) or SmolLM2."""
import pytest


pytest.importorskip("yaml")
pytest.importorskip("click")

from test_hostile_messages import run_cli  # noqa: E402,F401  (its helpers, shared)


def test_generate_names_a_prompt_that_is_not_utf8_and_a_huge_context(tmp_path, capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("jinja2")
    from qkv.models import load_llama
    from test_llama import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    bad = b"\xffhello".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match=r"^prompt: not UTF-8 text \(byte 0xff at character 0\)"):
        load_llama(path).generate(bad, max_new_tokens=1)
    rc, out, err = run_cli(capsys, "generate", bad, "--gguf", path)
    assert rc == 2 and err.startswith("qkv: error: PROMPT: not UTF-8 text (byte 0xff") and err.count("\n") == 1
    huge = tmp_path / "huge-context.gguf"
    write_tiny_llama(huge, context=2**32 - 1)
    with pytest.raises(ValueError, match=r"^huge-context.gguf: metadata llama.context_length is 4,294,967,295; "
                                         r"expected at most 1,048,576"):
        load_llama(huge)                                  # a 32 GiB arange (MemoryError) before
    rc, out, err = run_cli(capsys, "generate", "hi", "--gguf", huge)
    assert rc == 2 and "expected at most 1,048,576" in err and err.count("\n") == 1
