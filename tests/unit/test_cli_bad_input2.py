"""Bad input found by a probe, each a test: one line on stderr naming the option, exit code 2, nothing written,
and before the slow work (spawning the ring's processes, running the benchmark, loading the model).

- ``qkv ring``: --timeout in 1 … 600 s, --seed >= 0, P bounded by the cores and the memory, the arrays by the
  memory; the ranks' own stderr (torch's C++ log lines) never reaches the command's;
- ``qkv bench``: --json / --plot checked as file names up front; the memory check names every option in it;
- a locale file whose placeholder was renamed is named with the key and the placeholder;
- ``qkv generate`` / ``qkv view --generate``: the sampling settings checked before the model loads, by their
  options' names.
"""
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("click")

from qkv import locales  # noqa: E402

LOCALES = Path(__file__).resolve().parents[2] / "src" / "qkv" / "locales"


from cli_checks import one_line, run  # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------------------------- qkv ring
RING = ["ring", "-p", "2", "-n", "8", "--heads", "1", "--dim", "4"]


@pytest.mark.parametrize("args, pattern", [
    (["--timeout", "1e-9"], r"--timeout: expected 1 … 600 seconds, got 1e-09"),
    (["--timeout", "inf"], r"--timeout: expected 1 … 600 seconds, got inf"),
    (["--timeout", "nan"], r"--timeout: expected 1 … 600 seconds, got nan"),
    (["--timeout", "1000"], r"--timeout: expected 1 … 600 seconds"),
    (["--seed", "-1"], r"--seed: expected a non-negative integer, got -1"),
    (["--dim", "99999999999"], r"--dim: expected 1 … 4,096, got 99,999,999,999"),
    (["--heads", "99999999999"], r"--heads: expected 1 … 1,024, got 99,999,999,999"),
    (["-n", "16777216", "--heads", "1024", "--dim", "4096"],
     r"--length/--heads/--dim/--batch: .*H = 1024, E = 4096.* need about [\d,.]+ GiB"),
    (["-p", "1000", "-n", "2000"], r"--nproc: expected at most \d+ processes here \(8 per core"),
])
def test_ring_checks_before_starting_processes(capsys, args, pattern):
    t = time.perf_counter()
    one_line(*run(capsys, *RING, *args)[::2], pattern)
    assert time.perf_counter() - t < 3                                   # no process was started


def test_ring_processes_must_fit_the_memory(capsys, monkeypatch):
    from qkv.cli import ring_cmd
    monkeypatch.setattr(ring_cmd, "_available_bytes", lambda: 600 * 2**20)
    one_line(*run(capsys, "ring", "-p", "4", "-n", "8", "--heads", "1", "--dim", "4")[::2],
             r"--nproc: P = 4 processes need about 1.0 GiB \(about 250 MB each .*more than the 0.6 GiB")
    assert "--nproc" in run(capsys, "ring", "--help")[1] and "250 MB" in run(capsys, "ring", "--help")[1]


# ----------------------------------------------------------------------------------------------- qkv bench
BENCH = ["bench", "--lengths", "33", "--heads", "1", "--dim", "8", "--repeats", "1", "--no-memory", "--no-progress",
         "--impls", "tiled"]


def test_bench_checks_its_output_files_up_front(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    for args, pattern in ((["--json", "adir"], r"--json: cannot write 'adir': it is a folder"),
                          (["--json", ""], r"--json: expected a file name, got ''"),
                          (["--plot", ""], r"--plot: expected a file name, got ''"),
                          (["--plot", "adir"], r"--plot: cannot write 'adir': it is a folder"),
                          (["--json", "none/x.json"], r"--json: the folder of 'none/x.json' does not exist")):
        t = time.perf_counter()
        code, out, err = run(capsys, *BENCH, *args)
        one_line(code, err, pattern)
        assert out == "" and time.perf_counter() - t < 3, args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"] and not list((tmp_path / "adir").iterdir())


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root writes anywhere")
def test_bench_json_in_a_read_only_folder(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        one_line(*run(capsys, *BENCH, "--json", ro / "x.json")[::2], r"--json: cannot write .* is not writable")
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("args, pattern", [
    (["--dim", "4096", "--lengths", "1000000"],
     r"--lengths/--heads/--dim/--batch: N = 1000000, H = 1, E = 4096, B = 1 need about"),
    (["--batch", "4096", "--lengths", "1000000"],
     r"--lengths/--heads/--dim/--batch: N = 1000000, H = 1, E = 8, B = 4096 need"),
    (["--long", "16000000", "--dim", "4096"], r"--long/--dim: N = 16000000, E = 4096 need about"),
])
def test_bench_memory_check_names_the_options(capsys, args, pattern):
    one_line(*run(capsys, *BENCH, *args)[::2], pattern)


# ----------------------------------------------------------------------------------------------- locales
def _locale(tmp_path, monkeypatch, code, **changes):
    d = tmp_path / "locales"
    d.mkdir(exist_ok=True)
    data = json.loads((LOCALES / "en.json").read_text(encoding="utf-8"))
    data.update(changes)
    path = d / f"{code}.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    monkeypatch.setenv("QKV_LOCALES", str(d))
    return path


def test_a_renamed_placeholder_names_the_file_the_key_and_the_placeholder(capsys, tmp_path, monkeypatch):
    path = _locale(tmp_path, monkeypatch, "ww", **{"explain.step": "Step {bogus_n}"})
    code, out, err = run(capsys, "explain", "--lang", "ww")
    one_line(code, err, re.escape(f"locale file {path}: message 'explain.step' has the placeholder {{bogus_n}}, "
                                  "which the English one does not have (it has {n})"))
    assert out == ""
    with pytest.raises(ValueError, match=r"'explain.step' has the placeholder \{bogus_n\}"):
        locales.t("explain.step", "ww", n=1)


def test_locale_placeholder_checks_count_and_stray_braces(tmp_path, monkeypatch):
    _locale(tmp_path, monkeypatch, "wx", **{"explain.step": "Step {m}", "explain.head": "head {x}"})
    with pytest.raises(ValueError, match=r"and 1 more message like it; keep every placeholder of en.json"):
        locales.t("explain.step", "wx", n=1)
    _locale(tmp_path, monkeypatch, "wy", **{"explain.step": "Step {n"})
    with pytest.raises(ValueError, match=r"wy.json: message 'explain.step': .*a literal brace is written"):
        locales.t("explain.step", "wy", n=1)
    _locale(tmp_path, monkeypatch, "wz", **{"explain.step": "Schritt {n!r}"})         # a conversion is fine
    assert locales.t("explain.step", "wz", n=1) == "Schritt 1"


def test_a_message_formatted_with_other_names_names_the_key():
    with pytest.raises(ValueError, match=r"en.json: message 'explain.step': placeholder \{n\} is not one of m"):
        locales.t("explain.step", "en", m=3)


# ----------------------------------------------------------------------------------------------- generate, view
@pytest.mark.parametrize("args, pattern", [
    (["-n", "-1"], r"^qkv: error: -n/--max-new-tokens: expected an integer >= 1, got -1$"),
    (["-T", "nan"], r"^qkv: error: -T/--temperature: expected a finite number, got nan$"),
    (["--top-k", "0"], r"^qkv: error: --top-k: expected an integer >= 1, got 0$"),
    (["--top-p", "2"], r"^qkv: error: --top-p: expected a number in \(0, 1\], got 2.0$"),
    (["--seed", "-1"], r"^qkv: error: --seed: expected a non-negative integer, got -1$"),
])
def test_generate_names_its_options(capsys, args, pattern):
    t = time.perf_counter()
    code, out, err = run(capsys, "generate", "hi", *args)
    one_line(code, err, pattern)
    assert out == "" and time.perf_counter() - t < 3


@pytest.mark.parametrize("args, pattern", [
    (["-n", "-1"], r"^qkv: error: -n/--max-new-tokens: expected an integer >= 1, got -1$"),
    (["-T", "nan"], r"^qkv: error: -T/--temperature: expected a finite number, got nan$"),
    (["--seed", "-1"], r"^qkv: error: --seed: expected a non-negative integer, got -1$"),
])
def test_view_generate_checks_sampling_before_loading_the_model(capsys, tmp_path, args, pattern):
    t = time.perf_counter()
    code, out, err = run(capsys, "view", "--no-why", "-m", "smollm2", "--generate", "hi", *args,
                         "-o", tmp_path / "x.html")
    one_line(code, err, pattern)
    assert out == "" and not list(tmp_path.iterdir()) and time.perf_counter() - t < 3


def test_view_refuses_an_example_that_overflows_as_explain_does(capsys, tmp_path):
    f = tmp_path / "huge.yaml"
    f.write_text("X: [[1e300, 1e300], [3, 4]]\nW_Q: [[1e300], [2]]\nW_K: [[1e300], [2]]\nW_V: [[1], [2]]\n")
    out = tmp_path / "page.html"
    for args in (["explain", f], ["view", "--no-why", f, "-o", out]):
        code, _, err = run(capsys, *args)
        one_line(code, err, r"huge.yaml: Q overflowed")
    assert not out.exists()


def test_a_bad_provider_in_the_environment_is_one_line_of_warning():
    import subprocess
    env = dict(os.environ, QKV_GEMM="bogus", QKV_KERNELS="nope")
    r = subprocess.run([sys.executable, "-c", "import sys, qkv.cli; sys.exit(qkv.cli.run())", "examples"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "seed003" in r.stdout                 # it runs, with the default ("auto")
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr                                   # one line each, no source line under it
    assert "QKV_GEMM: expected one of ('auto', 'numpy', 'mkl'), got 'bogus'; using 'auto'" in lines[0]
    assert "QKV_KERNELS: expected one of ('auto', 'numpy', 'numba'), got 'nope'" in lines[1]
