"""``qkv bench --accuracy``: the error table of every path against float64 (:mod:`qkv.accuracy_table`)."""
import json
import time

import pytest

from cli_checks import one_line, run
from qkv import accuracy as A
from qkv import accuracy_table as T

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

KEYS = {"path", "dtype", "variant", "max_rel_err", "median_rel_err", "cases"}


@pytest.fixture(scope="module")
def every_variant_and_dtype():
    """One case of each variant in each dtype (48), every path."""
    return T.run(3 * len(A.VARIANTS))


def test_json_is_rows_with_exactly_the_documented_keys(capsys):
    code, out, err = run(capsys, "bench", "--accuracy", "--cases", 16, "--json", "--no-progress")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"rows"} and result["rows"]
    for row in result["rows"]:
        assert set(row) == KEYS, row
        assert row["path"] in T.PATHS and row["dtype"] in A.DTYPES and row["variant"] in A.VARIANTS
        assert isinstance(row["cases"], int) and row["cases"] >= 1
        assert 0 <= row["median_rel_err"] <= row["max_rel_err"]
    per_path = {}
    for row in result["rows"]:
        per_path[row["path"]] = per_path.get(row["path"], 0) + row["cases"]
    assert per_path["reference"] == per_path["tiled/numba backward"] == 16      # every case on every qkv path
    assert per_path.get("torch", 15) == 15                                      # torch has no sinks


def test_markdown_is_a_table_under_the_command_and_the_machine(capsys):
    code, out, err = run(capsys, "bench", "--accuracy", "--cases", 16, "--markdown", "--no-progress")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("`qkv bench --accuracy --cases 16 --markdown`")
    assert any("CPU " in line and "numpy " in line and "block kernels" in line for line in lines[:4])
    head = lines.index("| path | dtype | variant | max rel err | median rel err | cases |")
    assert lines[head + 1] == "|---|---|---|---:|---:|---:|"
    rows = lines[head + 2:]
    assert rows and all(r.startswith("| ") and r.count("|") == 7 for r in rows)
    assert any(r.startswith("| tiled/numba backward | float32 | causal |") for r in rows)


@pytest.mark.parametrize("args, pattern", [
    (["--cases", "2001"], r"--cases: with --accuracy expected 1 to 2000 problems"),
    (["--cases", "0"], r"expected 1 to 2000"),
    (["--cases", "many"], r"--cases: with --accuracy expected a number of problems, got 'many'"),
    (["--variants"], r"--variants: not offered with --accuracy"),
    (["--gemm-share"], r"--gemm-share: not offered with --accuracy"),
])
def test_bad_options_are_one_line_and_exit_2(args, pattern, capsys):
    code, out, err = run(capsys, "bench", "--accuracy", *args)
    one_line(code, err, pattern)


def test_help_states_the_bound_and_the_error(capsys):
    code, out, _ = run(capsys, "bench", "--help")
    text = " ".join(out.split())
    assert code == 0 and "at most 2000" in text and "max|got − ref| / max|ref| per case (normwise)" in text


def test_a_tiny_run_is_fast():
    t = time.perf_counter()
    result = T.run(4, torch=False)
    assert time.perf_counter() - t < 15
    assert {r["path"] for r in result["rows"]} >= {"reference", "tiled/numpy", "default", "default backward"}


def test_every_error_is_small(every_variant_and_dtype):
    """Every path, every variant: float64 to 1e-12, float32 to 2e-5 (torch's SDPA and flex_attention too),
    float16 — rounded to float16 at the end — to 5e-3."""
    bound = {"float64": 1e-12, "float32": 2e-5, "float16": 5e-3}
    rows = every_variant_and_dtype["rows"]
    assert len({(r["dtype"], r["variant"]) for r in rows}) == 3 * len(A.VARIANTS)
    bad = [r for r in rows if not r["max_rel_err"] <= bound[r["dtype"]]]
    assert not bad, bad
