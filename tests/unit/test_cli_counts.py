"""Every count the command line accepts has an upper bound, stated in --help and in the error (exit 2, one line);
the long runs show a progress bar on a terminal (issue 26)."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("click")

from qkv import lab  # noqa: E402
from qkv.cli import main  # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

QKV = Path(sys.executable).with_name("qkv")

BOUNDED = [  # (command, option, a value above the bound, the bound as --help and the error state it)
    (["lab", "train"], "--steps", 10**9, "100000"),
    (["lab", "train"], "--batch", 10**6, "4096"),
    (["lab", "heads"], "--steps", 10**9, "100000"),
    (["lab", "heads"], "--runs", 10**9, "100"),
    (["lab", "scale"], "--samples", 10**10, "1048576"),
    (["lab", "scale"], "--keys", 10**6, "1024"),
    (["explain"], "--heads", 5000, "1024"),
    (["explain"], "--ring", 10**6, "64"),
    (["model", "hi"], "--top", 5000, "1024"),
    (["ring", "-p", "2", "-n", "8"], "--repeats", 10**9, "100"),
    (["ring", "-p", "2", "-n", "8"], "--threads", 10**6, "1024"),
    (["ring", "-p", "2", "-n", "8"], "--dim", 10**6, "4096"),
    (["ring", "-p", "2", "-n", "8"], "--batch", 10**6, "4096"),
    (["ring", "-p", "2", "-n", "8"], "--heads", 10**6, "1024"),
    (["bench"], "--repeats", 10**9, "100"),
    (["bench"], "--heads", 10**6, "1024"),
    (["bench"], "--dim", 10**6, "4096"),
    (["bench"], "--batch", 10**6, "4096"),
    (["bench"], "--threads", 10**6, "1024"),
    (["bench"], "--long", 10**9, "16777216"),
]


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("command, option, value, bound", BOUNDED, ids=lambda x: str(x) if isinstance(x, str) else None)
def test_a_count_above_its_bound_is_refused_at_once_with_the_bound(capsys, command, option, value, bound):
    t = time.perf_counter()
    rc, out, err = run_cli(capsys, *command, option, value)
    assert time.perf_counter() - t < 10
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert option in err and re.search(bound[:-3] + r",?" + bound[-3:] if len(bound) > 3 else bound, err), err
    help_cmd = [w for w in command if not w.startswith("-") and not w.isdigit() and w != "hi"]
    rc, out, _ = run_cli(capsys, *help_cmd, "--help")
    help_line = " ".join(out.split())
    grouped = f"{int(bound):,}"
    assert rc == 0 and (f"<={bound}]" in help_line or f"… {grouped}" in help_line or f"… {bound}" in help_line), \
        (option, help_line)


@pytest.mark.parametrize("fn, kwargs, match", [
    (lab.train, dict(steps=10**9), r"steps: expected an integer from 1 to 100,000, got 1000000000"),
    (lab.train, dict(batch=10**6), r"batch: expected an integer from 1 to 4,096"),
    (lab.heads, dict(runs=10**9), r"runs: expected an integer from 1 to 100, got"),
    (lab.heads, dict(steps=10**100), r"steps: expected an integer from 1 to 100,000, got 1.000e\+100"),
    (lab.scale, dict(samples=10**10), r"samples: expected an integer from 1 to 1,048,576"),
    (lab.scale, dict(d_ks=[10**9]), r"d_ks: expected an integer from 1 to 65,536"),
])
def test_the_library_bounds_the_counts_too(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(**kwargs)


def test_the_experiments_report_their_progress():
    ticks = []
    lab.train(steps=3, batch=4, held_out=4, progress=ticks.append)
    assert ticks == [1] * 4
    ticks.clear()
    lab.heads(steps=2, runs=2, batch=4, held_out=4, progress=ticks.append)
    assert ticks == [1] * (2 * 2 * 3)
    ticks.clear()
    r = lab.scale(samples=40, keys=16, d_ks=(4, 8), progress=ticks.append)
    assert sum(ticks) == 2 * 48 and r["rows"][0]["d_k"] == 4       # 40 rows rounded up to 3 blocks of 16


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal")
def test_a_long_lab_run_shows_a_progress_bar_on_a_terminal(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))    # a terminal has a size
    p = subprocess.Popen([str(QKV), "lab", "heads", "--steps", "3000", "--runs", "1", "--json"],
                         stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    out, _ = p.communicate(timeout=240)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    assert p.returncode == 0
    text = err.decode("utf-8", "replace")
    assert "lab heads" in text and "step" in text and "%" in text, text[:500]
    assert out.lstrip().startswith(b"{")                     # stdout stays pure JSON


@pytest.mark.parametrize("lengths", ["1,2,3," * 11 + "4", "99999999999", "9" * 100_000])
def test_bench_lengths_are_bounded_in_number_and_size_with_a_short_message(capsys, lengths):
    rc, out, err = run_cli(capsys, "bench", "--lengths", lengths)
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and len(err) < 200, err
    assert "--lengths: expected 1 to 32 integers from 1 to 16,777,216" in err
