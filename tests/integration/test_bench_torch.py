"""The tests of tests/unit/test_bench.py that need torch or transformers."""

import pytest

from qkv import bench

pytest.importorskip("click")


def test_gemm_share_puts_torchs_sdpa_against_torchs_own_gemm():
    pytest.importorskip("torch")
    rows = bench.gemm_share(256, heads=1, dim=16, repeats=1, gemms=["numpy"])
    assert [(r["gemm"], r["mode"]) for r in rows] == [("numpy", "forward"), ("numpy", "causal"),
                                                       ("torch", "forward"), ("torch", "causal")]
    for r in rows[2:]:
        assert r["gemm_s"] is None and r["blocks"] == (64, 256) and r["wall_s"] > 0
        assert r["share"] == pytest.approx(r["gflops"] / r["gemm_gflops"])
        assert r["gflops"] == pytest.approx(bench.flops(r["mode"], 1, 1, 256, 16) / r["wall_s"] / 1e9)
    lines = bench.gemm_share_lines(rows)
    assert lines[4].startswith("| torch SDPA (its mm, 64×256 blocks) | forward | 256 |") and "| — |" in lines[4]
