"""``qkv bench`` on tiny sizes: the table, the JSON structure and the plot (never timing assertions)."""
import json
import platform

import numpy as np
import pytest

from qkv import bench
from qkv.tools.bench._env import _kernels_in_use
from qkv.cli import main

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

pytest.importorskip("click")

TINY = ["--lengths", "16,33", "--heads", "2", "--dim", "8", "--repeats", "2", "--threads", "2", "--no-progress"]


def test_bench_json_structure(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", *TINY, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for h in bench.HEADERS:
        assert h in printed                                   # the table is printed too
    res = json.loads(out.read_text())
    assert set(res) == {"machine", "config", "rows"}
    assert res["machine"]["matmul_gflops"] > 0 and res["config"]["threads"] == 2
    impls = res["config"]["impls"]
    assert len(res["rows"]) == 3 * 2 * len(impls)
    keys = {"mode", "n", "impl", "gemm", "median_s", "gflops", "pct_matmul", "peak_mb", "ratio_torch", "times_s"}
    for r in res["rows"]:
        assert set(r) == keys
        if r["impl"] == "reference" and r["mode"] == "backward":
            assert r["median_s"] is None                      # no reference backward
            continue
        assert r["median_s"] > 0 and len(r["times_s"]) == 2
        assert r["gflops"] == pytest.approx(bench.flops(r["mode"], 1, 2, r["n"], 8) / r["median_s"] / 1e9)
        assert r["peak_mb"] >= 0
        if "torch" in impls:
            assert r["ratio_torch"] > 0
            if r["impl"] == "torch":
                assert r["ratio_torch"] == pytest.approx(1.0)


def test_bench_json_to_stdout_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    assert main(["bench", *TINY, "--modes", "forward", "--impls", "tiled,reference", "--no-memory",
                 "--json", "--plot", str(png)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["impl"] for r in res["rows"]] == ["tiled", "reference"] * 2
    assert all(r["peak_mb"] is None and r["ratio_torch"] is None for r in res["rows"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_markdown_table(capsys):
    assert main(["bench", *TINY, "--modes", "causal", "--impls", "tiled", "--no-memory", "--markdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("| mode"))
    assert out[header + 1].startswith("|---|") and len(out) == header + 4      # header, rule, two rows
    assert out[header + 2].startswith("| causal | 16 | tiled |")


def test_bench_header_names_cpu_gemm_provider_kernel_and_rate(capsys):
    import qkv
    assert main(["bench", *TINY, "--modes", "forward", "--impls", "tiled", "--no-memory", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    from qkv import gemm
    m = res["machine"]
    choice = gemm.GEMM.choice                                    # the current choice (auto unless set)
    assert m["gemm"] == qkv.get_gemm() and res["config"]["gemms"] == [choice]
    prov = m["gemms"][choice]
    assert prov["gemm"] == qkv.get_gemm() and prov["exp"] in gemm.PROVIDERS
    assert prov["matmul_gflops"] > 0 and prov["kernel"]
    assert m["cpu"] == bench.cpu_model() and m["cpu"]
    line = bench.header(res)
    for part in (m["cpu"], f"GEMM {m['gemm']} in use", prov["kernel"], f"{prov['matmul_gflops']:.0f} GFLOP/s"):
        assert part in line
    assert all(r["gemm"] == choice for r in res["rows"])


def test_cpu_model_names_family_model_and_vector_unit(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                 "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw\n\n"
                 "processor\t: 1\nmodel name\t: something else\n")
    assert bench.cpu_model(str(f)) == "AMD EPYC (family 25 model 17, AVX-512)"
    f.write_text("model name\t: Intel(R) Xeon(R) CPU\ncpu family\t: 6\nmodel\t\t: 85\nflags\t\t: sse2 avx2\n")
    assert bench.cpu_model(str(f)) == "Intel(R) Xeon(R) CPU (family 6 model 85, AVX2)"
    f.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")              # no model name (an ARM board)
    assert bench.cpu_model(str(f)) == (platform.processor() or platform.machine() or "unknown")
    assert bench.cpu_model(str(tmp_path / "missing")) == (platform.processor() or platform.machine()
                                                          or "unknown")


def test_environment_line_names_cpu_blas_gemm_and_kernels(monkeypatch):
    import numpy as np
    import qkv
    from qkv import gemm, kernels
    line = bench.environment_line()
    for part in (f"CPU {bench.cpu_model()}", f"numpy {np.__version__} ({gemm.NumpyGemm.kernel()})",
                 f"GEMM {qkv.get_gemm()}", f"block kernels {_kernels_in_use()}"):
        assert part in line
    # the compiled loop of plain blocks, where it runs (numba and the provider's C sgemm), and only there
    assert line.endswith(", compiled loop") == (_kernels_in_use() != "numpy"
                                                and kernels.plain_available(gemm.GEMM.active()))
    from qkv.backends import tiled
    with tiled.limits(plain_loop=False):
        assert not bench.environment_line().endswith(", compiled loop")
    # QKV_KERNELS=numba without numba is an error of the engine's, not of a benchmark's first line
    monkeypatch.setattr(kernels.KERNELS, "choice", "numba")
    monkeypatch.setattr(kernels.KERNELS, "_jit", False)
    assert bench.environment_line().endswith("block kernels numpy")


def test_bench_gemm_providers_side_by_side(capsys):
    from qkv import gemm
    if gemm.GEMM.mkl() is None:
        pytest.skip("the mkl extra is not installed: pip install 'qkv[mkl]'")
    saved = gemm.GEMM.choice
    assert main(["bench", *TINY, "--modes", "forward", "--impls", "tiled,reference", "--no-memory",
                 "--gemm", "numpy,mkl,auto", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert gemm.GEMM.choice == saved                           # the run restores the choice
    assert [(r["impl"], r["gemm"]) for r in res["rows"]] == [("tiled (numpy)", "numpy"), ("tiled (mkl)", "mkl"),
                                                             ("tiled (auto)", "auto"), ("reference", None)] * 2
    assert set(res["machine"]["gemms"]) == {"numpy", "mkl", "auto"}
    auto = res["machine"]["gemms"]["auto"]
    assert (auto["gemm"], auto["exp"]) == gemm.GEMM.auto_choice()
    for r in res["rows"]:
        base = res["machine"]["gemms"][r["gemm"]]["matmul_gflops"] if r["gemm"] else res["machine"]["matmul_gflops"]
        assert r["pct_matmul"] == pytest.approx(100 * r["gflops"] / base)


def test_bench_gemm_mkl_without_the_extra_is_one_line(monkeypatch, capsys):
    from qkv import gemm
    monkeypatch.setattr(gemm, "_mkl_library_path", lambda: None)
    monkeypatch.setattr(gemm, "GEMM", gemm.Gemm())
    assert main(["bench", *TINY, "--gemm", "numpy,mkl"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'qkv[mkl]'" in err and len(err.strip().splitlines()) == 1


def test_gemm_share_times_the_forward_against_its_own_gemms():
    rows = bench.gemm_share(256, heads=1, dim=16, repeats=1, torch_sdpa=False)
    assert [r["mode"] for r in rows] == ["forward", "causal"]
    for r in rows:
        assert 0 < r["gemm_s"] < r["wall_s"]                     # the GEMMs are part of the call, not all of it
        assert r["share"] == pytest.approx(r["gflops"] / r["gemm_gflops"])
        assert r["gflops"] == pytest.approx(bench.flops(r["mode"], 1, 1, 256, 16) / r["wall_s"] / 1e9)
    lines = bench.gemm_share_lines(rows)
    assert len(lines) == 2 + len(rows) and lines[2].startswith(f"| {rows[0]['gemm']} | forward | 256 |")


def test_gemm_share_times_the_small_products_auto_keeps_on_numpy(monkeypatch):
    """Where auto took MKL, products under AUTO_RESOLVE_FLOPS run on NumPy: the share times them there too
    (it timed MKL's alone, and a small forward read 0 s of GEMM and a NaN rate)."""
    from qkv import gemm
    if "mkl" not in gemm.GEMM.available():
        pytest.skip("the mkl extra is not installed: pip install 'qkv[mkl]'")
    monkeypatch.delenv("QKV_GEMM", raising=False)
    fresh = gemm.Gemm()
    monkeypatch.setattr(gemm, "GEMM", fresh)
    fresh.calibration = {"chosen": "mkl", "exp": {"chosen": "numpy"}}   # what a Xeon's calibration chooses
    fresh.set("auto")
    rows = bench.gemm_share(33, heads=2, dim=8, repeats=1, torch_sdpa=False, gemms=["auto"])
    assert [r["mode"] for r in rows] == ["forward", "causal"]
    for r in rows:
        assert 0 < r["gemm_s"] < r["wall_s"] and np.isfinite(r["gemm_gflops"]) and np.isfinite(r["share"])
    assert "matmul" not in vars(fresh.mkl()) and "matmul" not in vars(fresh.provider("numpy"))   # the timers taken off


def test_torch_flash_blocks_follow_torchs_kernel():
    # aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: q split 256 from 768 rows, 64 from 192, else 32; kv 512
    assert [bench.torch_flash_blocks(n) for n in (4096, 768, 767, 192, 191, 16)] == [
        (256, 512), (256, 512), (64, 512), (64, 192), (32, 191), (16, 16)]


def test_bench_gemm_share_option_adds_its_rows(capsys):
    assert main(["bench", *TINY, "--modes", "forward", "--impls", "tiled", "--no-memory", "--gemm-share",
                 "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| GEMM | mode | N | ms |" in out and "| forward | 33 |" in out and "| causal | 33 |" in out


def test_bench_long_sequence_reports_peak_rss():
    res = bench.long_sequence(2048, heads=1, dim=8, threads=1)
    assert res["n"] == 2048 and res["finite"] and res["peak_rss_mb"] > 0 and res["seconds"] > 0


def test_bench_long_window_reports_peak_rss_and_fails_clearly():
    res = bench.long_window(2048, heads=1, dim=8, window=64, threads=1)
    assert res["n"] == 2048 and res["window"] == 64 and res["finite"] and res["peak_rss_mb"] > 0
    assert res["inputs_mb"] == pytest.approx(4 * 2048 * 8 * 4 / 2**20)
    with pytest.raises(RuntimeError, match="long sliding-window run failed"):
        bench.long_window(2048, heads=1, dim=8, window=0, threads=1)          # no window: the child raises


@pytest.mark.parametrize("args, msg", [(["--lengths", "a,b"], "--lengths"), (["--modes", "sideways"], "--modes"),
                                       (["--threads", "0"], "--threads"), (["--impls", "jax"], "--impls"),
                                       (["--json", "/no/such/dir/b.json"], "--json"),
                                       (["--gemm", "blis"], "--gemm"),
                                       (["--variants", "--gemm", "numpy,mkl"], "--gemm"),
                                       (["--plot", "/no/such/dir/b.png"], "--plot")])
def test_bench_bad_options_one_line(args, msg, capsys):
    assert main(["bench", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_bench_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    # --json and --plot go through the one atomic writer (counted); a failure while writing leaves nothing
    pytest.importorskip("matplotlib")
    import qkv._files
    from qkv.cli import bench_cmd
    real = qkv._files.atomic_write
    names = []

    def counting(path, *a, **kw):
        names.append(str(path).rsplit("/", 1)[-1])
        return real(path, *a, **kw)
    monkeypatch.setattr(bench_cmd, "atomic_write", counting)
    monkeypatch.setattr(qkv._files, "atomic_write", counting)
    args = ["bench", *TINY, "--modes", "forward", "--impls", "tiled", "--no-memory"]
    assert main([*args, "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.svg")]) == 0
    assert sorted(names) == ["b.json", "b.svg"]
    assert json.loads((tmp_path / "b.json").read_text())["rows"]
    assert (tmp_path / "b.svg").read_text().lstrip().startswith(("<?xml", "<svg"))

    def broken(result):
        raise MemoryError
    monkeypatch.setattr(bench, "dumps", broken)
    assert main([*args, "--json", str(tmp_path / "c.json")]) != 0          # the CLI's one-line error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "b.svg"]


def test_variants_report_each_ratio_beside_its_work_fraction():
    """qkv bench --variants: the share of the scores each variant's block mask allows, beside its time ratio."""
    from qkv.bench import variants, variants_markdown
    r = variants(heads=1, dim=16, repeats=1, window_n=512, window=64, docs=2, doc_len=256,
                 cases=("window", "documents"), long_n=None, progress=False)
    wf = {x["what"]: x["work_fraction"] for x in r["ratios"]}
    n, w = 512, 64
    allowed = sum(min(i + 1, w) for i in range(n))
    assert abs(wf["window / qkv full causal"] - allowed / (n * (n + 1) / 2)) < 1e-12
    assert wf["packed / separate"] == 1.0                        # the same scores, one call or two
    # sinks + window and the prefix LM: their targets are their work fractions plus 25 %
    tg = {x["what"]: x["target"] for x in r["ratios"]}
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    sinks = np.count_nonzero(((i - j >= 0) & (i - j < w)) | (j < 4))     # the sinks are seen by every query
    plm = np.count_nonzero((j < n // 8) | (j <= i))
    assert abs(wf["sinks + window / qkv full causal"] - sinks / (n * (n + 1) / 2)) < 1e-12
    assert abs(wf["prefix LM / qkv full causal"] - plm / (n * (n + 1) / 2)) < 1e-12
    for what in ("sinks + window / qkv full causal", "prefix LM / qkv full causal"):
        assert abs(tg[what] - 1.25 * wf[what]) < 1e-12
    assert "| work fraction |" in variants_markdown(r)
