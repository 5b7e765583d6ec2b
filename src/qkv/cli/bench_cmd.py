"""``qkv bench``: the engine side by side with torch's SDPA (the logic lives in :mod:`qkv.bench`)."""
from __future__ import annotations

import os
import sys

import click

from qkv.cli import UserError
from qkv.cli._app import cli
from qkv._checks import available_bytes as _available_bytes
from qkv._files import atomic_write, output_kind


#: Bounds of the sweep's counts (stated in --help and the errors): a length N, and how many lengths.
MAX_LENGTH = 1 << 24
MAX_LENGTHS = 32


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:40] + "…"


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x] if len(text) <= 10_000 else None
    except ValueError:
        vals = None
    if not vals or min(vals) < 1 or max(vals) > MAX_LENGTH or len(vals) > MAX_LENGTHS:
        raise UserError(f"{name}: expected 1 to {MAX_LENGTHS} integers from 1 to {MAX_LENGTH:,}, comma-separated "
                        f"like 512,1024, got {_short(text)!r}")
    return vals


def _check_memory(lengths, batch: int, heads: int, dim: int, backward: bool, long_n) -> None:
    """A one-line error before the run when its largest arrays cannot fit: each cell allocates Q, K, V and
    grad_out (B×H×N×E float32), and the output (and with backward dQ, dK, dV) as large. The error names every
    option in the product, since any of them can be the one too large."""
    avail = _available_bytes()
    if avail is None:
        return
    n = max(lengths)
    arrays = 8 if backward else 5
    need = arrays * n * 4 * batch * heads * dim
    if need > avail:
        raise UserError(f"--lengths/--heads/--dim/--batch: N = {n}, H = {heads}, E = {dim}, B = {batch} need about "
                        f"{need / 2**30:,.1f} GiB for the Q, K, V and output arrays ({arrays} × B·H·N·E float32), "
                        f"more than the {avail / 2**30:,.1f} GiB available here; give smaller ones")
    if long_n is not None:
        need = 4 * long_n * 4 * dim
        if need > avail:
            raise UserError(f"--long/--dim: N = {long_n}, E = {dim} need about {need / 2**30:,.1f} GiB for the Q, K, V "
                            f"and output arrays (4 × N × E float32, one head), more than the "
                            f"{avail / 2**30:,.1f} GiB available here; give smaller ones")


def _check_output(opt: str, path) -> None:
    """--json / --plot FILE, before a long run rather than after it: a file name whose folder exists and takes
    files (``-`` for --json is stdout)."""
    if path is None or output_kind(path) != "file":      # -, a pipe or a device: written to directly
        return
    if not path.strip():
        raise UserError(f"{opt}: expected a file name, got {path!r}")
    if os.path.isdir(path):
        raise UserError(f"{opt}: cannot write {path!r}: it is a folder, expected a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"{opt}: the folder of {path!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{opt}: cannot write {path!r}: the folder {folder!r} is not writable")


def _check_plot(plot_out, variants: bool) -> None:
    """--plot FILE of the sweep: a .png, .svg or .pdf name, and matplotlib there, before the run."""
    if not plot_out or variants:
        return
    if output_kind(plot_out) == "file" and os.path.splitext(plot_out)[1].lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--plot: expected a file name ending in .png, .svg or .pdf, got {plot_out!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'qkv[viz]'") from None


def _json(result: dict, json_out) -> bool:
    """``--json``: the result to stdout (``-``: True, nothing else is printed) or written whole to the file."""
    from qkv.tools import bench as B
    if json_out == "-":
        click.echo(B.dumps(result))
        return True
    if json_out:
        with atomic_write(json_out, "w", encoding="utf-8") as f:
            f.write(B.dumps(result) + "\n")
    return False


def _words(text: str, name: str, allowed) -> list[str]:
    vals = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in vals if x not in allowed]
    if bad or not vals:
        raise UserError(f"{name}: expected some of {','.join(allowed)}, got {text!r}")
    return vals


@cli.command("bench")
@click.option("--lengths", default="512,1024,2048,4096", show_default=True,
              help="Sequence lengths N, comma-separated (1 to 32 of them, each 1 … 16,777,216).")
@click.option("--modes", default="forward,causal,backward", show_default=True,
              help="Any of forward, causal, backward (= gradients from grad_out, forward included).")
@click.option("--impls", default="tiled,reference,torch", show_default=True,
              help="Any of tiled, reference, torch (torch is skipped when not installed).")
@click.option("--heads", default=8, show_default=True, type=click.IntRange(1, 1024), help="Heads H.")
@click.option("--dim", default=64, show_default=True, type=click.IntRange(1, 4096), help="Head width E.")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1, 4096), help="Batch B.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Timed calls of each (median).")
@click.option("--threads", default=None, type=click.IntRange(1, 1024),
              help="Threads for qkv and torch (default: the available cores).")
@click.option("--memory/--no-memory", default=True, show_default=True, help="Measure peak memory per call.")
@click.option("--long", "long_n", default=None, type=click.IntRange(1, MAX_LENGTH),
              help="Also run one tiled forward of this length with 1 head in a fresh process and report its "
                   "peak RSS (e.g. 65536).")
@click.option("--json", "json_out", default=None, is_flag=False, flag_value="-",
              help="Write the results as JSON to FILE; --json alone prints JSON instead of the table.")
@click.option("--plot", "plot_out", default=None, metavar="FILE", help="Save a plot of time against N (matplotlib).")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown (as in the README).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@click.option("--variants", is_flag=True,
              help="Instead of the sweep: the attention variants against their targets — sliding window 512 "
                   "(N=8192) vs qkv's full causal and torch with the dense mask, 8 packed documents vs 8 calls, "
                   "ALiBi/softcap/RoPE vs plain (N=4096), the flex backward vs torch autograd (N=2048), and "
                   "the peak RSS of an N=65536 window forward (--long changes N).")
@click.option("--cases", default="window,documents,mods,backward", show_default=True,
              help="With --variants: which cases to run. With --accuracy: how many problems N (default 144, at "
                   "most 2000).")
@click.option("--accuracy", is_flag=True,
              help="Instead of timing: the error table. The differential matrix's problems (--cases N of them, "
                   "drawn by a seeded NumPy generator: 16 variants × float32/float64/float16, sizes and the "
                   "engine's thresholds drawn) through every path — reference, tiled/numpy, tiled/numba, "
                   "tiled/numba+mkl, default (backend=None), torch's own SDPA/flex_attention where installed, and "
                   "each qkv path's backward — per path × dtype × variant the largest and median relative error "
                   "against a float64 reference and the number of cases. Relative error = max|got − ref| / "
                   "max|ref| per case (normwise), over the output (forward) or over dq, dk, dv, d sink_logits "
                   "together (backward). With --markdown or --json.")
@click.option("--plan", "show_plan", is_flag=True,
              help="Instead of timing: print the tiled engine's plan of each case (qkv.plan: strategy and reason per "
                   "task, pieces, work fraction) — the sweep's --lengths × --modes, or with --variants its --cases.")
@click.option("--gemm", "gemm_names", default=None, metavar="NAMES",
              help="GEMM providers for the tiled engine, comma-separated, side by side in one run: any of numpy, "
                   "mkl (pip install 'qkv[mkl]'), auto (default: the one in use, qkv.get_gemm()).")
@click.option("--gemm-share", "share", is_flag=True,
              help="Also: the tiled forward and causal forward at the largest N on one thread against the GEMMs "
                   "inside them (CPU time): the share of the GEMM's rate the forward reaches, per provider; "
                   "with torch installed, torch's SDPA too, against torch.mm on its kernel's blocks.")
def bench(lengths, modes, impls, heads, dim, batch, repeats, threads, memory, long_n, json_out, plot_out,
          markdown, progress, variants, cases, accuracy, show_plan, gemm_names, share):
    """Time qkv's tiled engine, its reference path and torch's SDPA side by side (float32).

    Each row: median time, GFLOP/s, % of this machine's matmul rate (measured in the same run), peak memory,
    and the time relative to torch. The implementations run interleaved, so machine noise hits all alike.
    """
    from qkv.tools import bench as B

    for opt, path in (("--json", json_out), ("--plot", plot_out)):      # fail before a long run, not after
        _check_output(opt, path)
    if json_out == "-" and plot_out == "-":
        raise UserError("--json - and --plot -: both would go to standard output; give one of them a file name")
    if accuracy:
        return _accuracy(click.get_current_context().params)
    if show_plan:
        return _plans(click.get_current_context().params)
    _check_plot(plot_out, variants)                                     # its format and matplotlib, up front too
    for name, val in (("--heads", heads), ("--dim", dim), ("--batch", batch), ("--repeats", repeats),
                      ("--threads", threads), ("--long", long_n)):
        if val is not None and val < 1:
            raise UserError(f"{name}: expected a positive integer, got {val}")
    gemms = None
    if gemm_names is not None:
        from qkv.compute import gemm
        gemms = _words(gemm_names, "--gemm", ("auto",) + gemm.PROVIDERS)
        if "mkl" in gemms and gemm.GEMM.mkl() is None:
            raise UserError("--gemm: mkl is not installed here: pip install 'qkv[mkl]'")
        if variants and len(set(gemms)) > 1:
            raise UserError("--gemm: with --variants give one provider (the variants compare cases, not providers)")
    if variants:
        return _variants(gemms, plot_out, heads, dim, repeats, threads, long_n, progress, cases, json_out, markdown)
    n_list = _ints(lengths, "--lengths")
    mode_list = _words(modes, "--modes", B.MODES)
    impl_list = _words(impls, "--impls", B.IMPLS)
    _check_memory(n_list, batch, heads, dim, "backward" in mode_list, long_n)
    result = B.run(n_list, heads=heads, dim=dim, batch=batch, repeats=repeats,
                   threads=threads, modes=mode_list, impls=impl_list, memory=memory, progress=progress,
                   gemms=gemms)
    if long_n is not None:
        result["long"] = B.long_sequence(long_n, dim=dim, threads=threads)
    if share:
        share_modes = ("forward", "causal") + (("backward",) if "backward" in mode_list else ())
        result["gemm_share"] = B.gemm_share(max(n_list), dim=dim, gemms=gemms, repeats=max(3, min(repeats, 5)),
                                            modes=share_modes)
    if plot_out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'qkv[viz]'") from None
        B.plot(result, plot_out)
    if _json(result, json_out) or plot_out == "-":           # (standard output carried the JSON or the picture)
        return 0
    if markdown:
        click.echo(B.markdown(result))
    else:
        _print_table(result, impl_list)
    if share:
        click.echo("")
        for line in B.gemm_share_lines(result["gemm_share"]):
            click.echo(line)
    if plot_out:
        click.echo(f"plot: {plot_out}")
    if json_out:
        click.echo(f"json: {json_out}")
    return 0


def _print_table(result: dict, requested=None) -> None:
    from qkv.tools import bench as B

    m, c = result["machine"], result["config"]
    title = B.header(result)
    if not m["torch"] and "torch" in (c["impls"] if requested is None else requested):   # asked for, not importable
        title += "; torch not installed"
    rows = B.format_table(result)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        click.echo(title)
        click.echo(" | ".join(B.HEADERS))
        for r in rows:
            click.echo(" | ".join(r))
    else:
        table = Table(title=title)
        for h in B.HEADERS:
            table.add_column(h, justify="left" if h in ("mode", "impl") else "right")
        for r in rows:
            table.add_row(*r)
        Console(file=sys.stdout, width=max(100, len(title) + 4)).print(table)
    if "long" in result:
        lg = result["long"]
        click.echo(f"long: N={lg['n']} H={lg['heads']} E={lg['dim']} tiled forward {lg['seconds']:.2f} s, peak RSS "
                   f"{lg['peak_rss_mb']:.0f} MB (its score matrix alone would take "
                   f"{lg['scores_would_take_mb']:.0f} MB)")


def _variants(gemms, plot_out, heads, dim, repeats, threads, long_n, progress, cases, json_out, markdown) -> int:
    """``qkv bench --variants``: the attention variants against their targets."""
    from qkv.tools import bench as B
    if gemms is not None:
        from qkv.compute import gemm
        gemm.set_gemm(gemms[0])
    if plot_out:
        raise UserError("--plot: not offered with --variants (its rows are not a sweep over N)")
    result = B.variants(heads=heads, dim=dim, repeats=repeats, threads=threads,
                        long_n=65536 if long_n is None else long_n, progress=progress,
                        cases=_words(cases, "--cases", ("window", "documents", "mods", "backward")))
    if _json(result, json_out):
        return 0
    if markdown:
        click.echo(B.variants_markdown(result))
    else:
        click.echo(B.header(result))
        for line in B.variants_text(result):
            click.echo(line)
    if json_out:
        click.echo(f"json: {json_out}")
    return 0


def _plans(params: dict) -> int:
    """``qkv bench --plan``: the plans of the cases (:mod:`qkv.bench.plans`), nothing timed."""
    from qkv.tools.bench import plans as PL
    for name, key in (("--plot", "plot_out"), ("--gemm-share", "share"), ("--long", "long_n"), ("--json", "json_out"),
                      ("--markdown", "markdown")):
        if params[key]:
            raise UserError(f"{name}: not offered with --plan (it prints plans, it times nothing)")
    if params["variants"]:
        got = PL.variant_plans(_words(params["cases"], "--cases", ("window", "documents", "mods", "backward")),
                               params["heads"], params["dim"], params["threads"])
    else:
        from qkv.tools import bench as B
        lengths = _ints(params["lengths"], "--lengths")
        if max(lengths) > 65536:
            raise UserError(f"--lengths: with --plan at most 65536 (the inputs are made), got {max(lengths)}")
        got = PL.sweep_plans(lengths, _words(params["modes"], "--modes", B.MODES), params["heads"], params["dim"],
                             params["batch"], params["threads"])
    click.echo(PL.render(got))
    return 0


def _accuracy(params: dict) -> int:
    """``qkv bench --accuracy``: the error table of :mod:`qkv.accuracy_table` (``params``: the command's options)."""
    from qkv.tools import accuracy_table as T
    from qkv.tools import bench as B
    cases, markdown, json_out = params["cases"], params["markdown"], params["json_out"]
    for name, key in (("--variants", "variants"), ("--plot", "plot_out"), ("--gemm-share", "share"),
                      ("--long", "long_n"), ("--gemm", "gemm_names")):
        if params[key]:
            raise UserError(f"{name}: not offered with --accuracy (it runs every path on problems of its own)")
    n = T.DEFAULT_CASES
    if click.get_current_context().get_parameter_source("cases") != click.core.ParameterSource.DEFAULT:
        try:
            n = int(cases)
        except ValueError:
            raise UserError(f"--cases: with --accuracy expected a number of problems, got {cases!r}") from None
        if not 1 <= n <= T.MAX_CASES:
            raise UserError(f"--cases: with --accuracy expected 1 to {T.MAX_CASES} problems (each runs every "
                            f"path), got {n}")
    bar = B.progress_bar(n, params["progress"])
    try:
        result = T.run(n, progress=None if bar is None else (lambda: bar.update(1)))
    finally:
        if bar is not None:
            bar.close()
    if _json(result, json_out):
        return 0
    head = T.header(n, f"qkv bench --accuracy --cases {n}{' --markdown' if markdown else ''}")
    click.echo(T.markdown(result, head) if markdown else T.text(result, head))
    if json_out:
        click.echo(f"json: {json_out}")
    return 0
