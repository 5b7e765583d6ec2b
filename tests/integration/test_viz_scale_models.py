"""The tests of tests/unit/test_viz_scale.py that need a model package (MiniLM, SmolLM2) or its readers.

Pictures at any size (issue 11): the heatmap's size, numbers and tick labels follow the matrix's size, memory
and time stay bounded (measured in a subprocess: its peak RSS read back), and writes are atomic."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("click")


ROOT = Path(__file__).resolve().parents[2]
QKV = Path(sys.executable).with_name("qkv")

#: Runs a command as its only child and prints the child's peak RSS (kB) and wall time (s) as the last line.
PEAK = textwrap.dedent("""
    import resource, subprocess, sys, time
    t = time.perf_counter()
    p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    dt = time.perf_counter() - t
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(p.returncode, ru.ru_maxrss, round(min(dt, ru.ru_utime + ru.ru_stime), 2))
""")


def peak(*cmd, timeout=240):
    """(exit code, stdout, stderr, peak RSS in MB, seconds) of ``cmd`` run in a fresh process.

    The seconds are the lesser of its wall time and its CPU time (user + system): on a quiet machine the
    wall time, and when other jobs share the cores (``pytest -n``, CI neighbours) the work it really did,
    which a loaded machine does not inflate (a 46 s wall time was measured for a 20 s job under load 7)."""
    p = subprocess.run([sys.executable, "-c", PEAK, *map(str, cmd)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    *out, last = p.stdout.rstrip("\n").split("\n")
    rc, kb, secs = last.split()
    return int(rc), "\n".join(out), p.stderr, int(kb) / 1024, float(secs)


@pytest.mark.model
def test_minilm_grid_of_512_tokens_is_bounded(tmp_path):
    try:
        from qkv.models import load_bert
        load_bert()
    except ImportError as exc:
        pytest.skip(f"no model: {exc}")
    words = "the cat sat on a mat and looked at birds flying over old houses near the river".split()
    text = " ".join(words[i % len(words)] for i in range(600))            # more than 512 tokens
    out = tmp_path / "grid.svg"
    rc, stdout, err, mb, secs = peak(QKV, "heatmap", "--text", text, "--layer", "2", "-o", out)
    assert rc == 0, err
    print(f"MiniLM 12-head grid, 512 tokens: peak RSS {mb:.0f} MB, {secs:.1f} s")
    assert mb < 1024 and secs < 30
    assert err.count("\n") == 1 and err.startswith("qkv: warning:") and "512 tokens" in err   # truncated
    svg = out.read_text(encoding="utf-8")
    assert svg.count("head ") >= 12
    assert "all-MiniLM-L6-v2: layer 2" in svg and "nreimers" not in svg
