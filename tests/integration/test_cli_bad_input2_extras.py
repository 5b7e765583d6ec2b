"""The tests of tests/unit/test_cli_bad_input2.py that need torch or the llama extra."""
import os
import re

import pytest

pytest.importorskip("click")

from cli_checks import one_line, run  # noqa: E402


def _loud(rank, nproc):
    """Writes to the process's stderr as torch's C++ logging does; rank 1 then dies without a result."""
    os.write(2, f"[E socket.cpp] rank {rank} says something on stderr\n".encode())
    if rank == 1:
        os._exit(3)
    return rank


def test_quiet_launch_keeps_the_ranks_stderr_out_and_names_a_dead_ranks_last_line(capfd):
    pytest.importorskip("torch")
    from qkv.distributed import launch
    with pytest.raises(RuntimeError) as e:
        launch(_loud, 2, timeout=20.0, deadline=60.0, quiet=True)
    msg = str(e.value)
    assert "rank 0" not in msg, msg                                      # rank 0 finished
    assert re.search(r"rank 1 failed after [0-9.]+ s: the process exited with code 3 without a result \(its last line on stderr: "
                     r"\[E socket.cpp\] rank 1 says something on stderr\)", msg), msg
    assert "says something" not in capfd.readouterr().err


def test_generate_names_gguf(capsys, tmp_path):
    one_line(*run(capsys, "generate", "hi", "--gguf", tmp_path / "none.gguf")[::2],
             r"^qkv: error: --gguf: no such file: .*none.gguf$")
    (tmp_path / "notes.gguf").write_text("not a model")
    one_line(*run(capsys, "generate", "hi", "--gguf", tmp_path / "notes.gguf")[::2],
             r"^qkv: error: --gguf: notes.gguf is not a GGUF file")
