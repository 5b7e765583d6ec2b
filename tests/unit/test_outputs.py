"""Outputs written as Unix tools write them (issue 40): a regular file replaced atomically, a link's target
written (the link kept), ``-`` to standard output, a FIFO or device written to directly — never replaced —, and
nothing written at all where the writer fails."""
import os
import stat
import subprocess
import sys
import threading

import pytest

from qkv._files import atomic_write, output_kind

from cli_checks import run


def test_a_regular_file_is_replaced_whole(tmp_path):
    f = tmp_path / "out.json"
    f.write_text("old")
    with atomic_write(f, "w", encoding="utf-8") as fh:
        fh.write("new")
    assert f.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]
    with pytest.raises(RuntimeError):
        with atomic_write(f, "w", encoding="utf-8") as fh:
            fh.write("half")
            raise RuntimeError("the writer failed")
    assert f.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]


def test_a_link_stays_a_link_and_its_target_is_written(tmp_path):
    target = tmp_path / "real.html"
    target.write_text("old")
    link = tmp_path / "page.html"
    link.symlink_to(target)
    with atomic_write(link, "w", encoding="utf-8") as fh:
        fh.write("new")
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "new"
    dangling = tmp_path / "later.html"
    dangling.symlink_to(tmp_path / "made.html")
    with atomic_write(dangling, "wb") as fh:
        fh.write(b"x")
    assert dangling.is_symlink() and (tmp_path / "made.html").read_bytes() == b"x"


def test_a_fifo_s_reader_gets_the_data_and_the_fifo_stays(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    assert output_kind(fifo) == "stream"
    with atomic_write(fifo, "wb") as fh:
        fh.write(b"attention")
    reader.join(10)
    assert got == [b"attention"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_device_is_written_to_not_replaced():
    assert output_kind("/dev/null") == "stream"            # (else the next lines would replace it)
    with atomic_write("/dev/null", "w", encoding="utf-8") as fh:
        fh.write("gone")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    with pytest.raises(OSError):                           # /dev/full: the error, as the CLI shows it
        with atomic_write("/dev/full", "wb") as fh:
            fh.write(b"x" * 10)


def test_a_failing_writer_writes_nothing_to_a_stream(tmp_path, capfdbinary):
    with pytest.raises(ValueError):
        with atomic_write("-", "wb") as fh:
            fh.write(b"half")
            raise ValueError("no")
    assert capfdbinary.readouterr().out == b""


def test_the_commands_write_through_dash_fifos_and_devices(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = run(capsys, "bench", "--lengths", 16, "--repeats", 1, "--impls", "tiled", "--modes", "forward",
                         "--no-progress", "--json", "/dev/null")
    assert code == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    code, out, err = run(capsys, "view", "-o", "-")
    assert code == 0 and out.lstrip().lower().startswith("<!doctype html"), err
    fifo = tmp_path / "heat"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    code, out, err = run(capsys, "heatmap", "-o", fifo)
    reader.join(30)
    assert code == 0, err
    assert got and got[0].startswith(b"\x89PNG") and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_standard_output_carries_the_picture_alone(capsys):
    pytest.importorskip("matplotlib")
    code, out, err = run(capsys, "lab", "scale", "--samples", 64, "--plot", "-", "--json")
    assert code == 2 and "standard output" in err and err.count("\n") == 1
    code, out, err = run(capsys, "bench", "--json", "-", "--plot", "-")
    assert code == 2 and "standard output" in err and err.count("\n") == 1


QKV = [sys.executable, "-c", "from qkv.cli import run; run()"]


@pytest.mark.parametrize("args", [["--help"], ["lab"], ["explain"], []])
def test_a_closed_pipe_ends_quietly_as_sigpipe_would(args):
    """`qkv --help | head -1`, `qkv lab | true`: the reader gone, no traceback, the shell's SIGPIPE status."""
    r, w = os.pipe()
    os.close(r)
    try:
        got = subprocess.run(QKV + args, stdout=w, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(w)
    assert got.returncode == 141 and got.stderr == b"", got.stderr.decode()


@pytest.mark.parametrize("args", [["--help"], ["explain"], []])
def test_a_full_device_is_one_line_and_exit_2(args):
    with open("/dev/full", "w") as full:
        got = subprocess.run(QKV + args, stdout=full, stderr=subprocess.PIPE, timeout=120)
    err = got.stderr.decode()
    assert got.returncode == 2 and err.count("\n") == 1 and "No space left" in err and "Traceback" not in err, err
