"""The sweep's result as a table, Markdown, a plot or JSON (:mod:`qkv.bench`)."""
from __future__ import annotations

import json
import math
import os

from qkv.tools.bench._env import header
from qkv.tools.bench._sweep import IMPLS


def format_table(result: dict) -> list[list[str]]:
    """Rows of strings for a table: mode, N, impl, median ms, GFLOP/s, % matmul, peak MB, × torch."""
    out = []
    for r in result["rows"]:
        def f(x, fmt):
            return "—" if x is None else format(x, fmt)
        out.append([r["mode"], str(r["n"]), r["impl"], f(None if r["median_s"] is None else r["median_s"] * 1e3,
                                                         ".1f"),
                    f(r["gflops"], ".1f"), f(r["pct_matmul"], ".0f"), f(r["peak_mb"], ".1f"),
                    f(r["ratio_torch"], ".2f")])
    return out


HEADERS = ("mode", "N", "impl", "median ms", "GFLOP/s", "% matmul", "peak MB", "× torch")


def markdown(result: dict) -> str:
    """The table as GitHub Markdown, with a line saying what ran where (for the README)."""
    lines = [header(result), "",
             "| " + " | ".join(HEADERS) + " |",
             "|" + "|".join("---" if h in ("mode", "impl") else "---:" for h in HEADERS) + "|"]
    for row in format_table(result):
        lines.append("| " + " | ".join(row) + " |")
    if "long" in result:
        lg = result["long"]
        lines += ["", f"Long: N = {lg['n']}, H = {lg['heads']}, E = {lg['dim']}: tiled forward {lg['seconds']:.1f} s, "
                      f"peak RSS {lg['peak_rss_mb']:.0f} MB (the score matrix alone would take "
                      f"{lg['scores_would_take_mb']:.0f} MB)."]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Median time against N, one panel per mode, one line per implementation (matplotlib, lazily)."""
    matplotlib = __import__("qkv._extras", fromlist=["need"]).need("matplotlib", "qkv.bench.plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = result["config"]["modes"]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 3.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for impl in result["config"]["impls"]:
            pts = [(r["n"], r["median_s"]) for r in result["rows"]
                   if r["mode"] == mode and r["impl"] == impl and r["median_s"] is not None]
            if pts:                                               # one colour per implementation
                ax.plot(*zip(*pts), marker="o", label=impl, color=f"C{IMPLS.index(impl)}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(mode)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("median seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    c = result["config"]
    fig.suptitle(f"qkv bench: B={c['batch']} H={c['heads']} E={c['dim']} float32, {c['threads']} threads")
    fig.tight_layout()
    from qkv._files import atomic_write
    fmt = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    fmt = fmt if fmt in ("png", "svg", "pdf") else "png"   # (-, a pipe or a device without one of them: PNG)
    with atomic_write(path, "wb") as fh:                 # whole or not at all
        fig.savefig(fh, format=fmt, dpi=120)
    plt.close(fig)


def dumps(result: dict) -> str:
    return json.dumps(result, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
