"""The sweep of :func:`qkv.bench.run`: each mode and length, the implementations interleaved; and the long
forward in a fresh process (:func:`long_sequence`)."""
from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from qkv.tools.bench._env import _machine
from qkv.tools.bench._measure import (_blas_threads, _check_gemms, _make_calls, progress_bar, _thread_counts, flops, gemm_info,
                       matmul_rate, memory_in_fresh_process)


MODES = ("forward", "causal", "backward")
IMPLS = ("tiled", "reference", "torch")
#: The reference runs when its (B, H, N, N) temporaries (about four of them) fit in this many bytes.
REFERENCE_MAX_BYTES = 2 << 30
#: A pause before each implementation's turn, so that the previous one's idle worker threads do not eat
#: into its time (OpenBLAS's threads, after the reference's multi-threaded matmuls, and torch's OpenMP
#: threads spin for tens of milliseconds before they sleep). Each turn then makes one untimed call and
#: one timed call: after a pause the first call runs cold (measured: up to +40 % at N = 2048, as the
#: cores and caches wake up), and attention is usually called in a loop.
SETTLE_S = 0.05


def run(lengths=(512, 1024, 2048, 4096), *, heads: int = 8, dim: int = 64, batch: int = 1, repeats: int = 5,
        threads: int | None = None, modes=MODES, impls=IMPLS, memory: bool = True, progress: bool = True,
        reference_max_bytes: int = REFERENCE_MAX_BYTES, gemms=None) -> dict:
    """Run the sweep; returns a JSON-ready dict ``{"machine", "config", "rows"}`` (see README, *Engine*).

    ``gemms``: the GEMM providers to run the tiled engine with, side by side (``("numpy", "mkl")``); None:
    the one in use (:func:`qkv.get_gemm`). Each row has ``gemm``: its provider (None for reference/torch).
    """
    from qkv import _checks

    lengths = [_checks.positive_int(n, "lengths") for n in lengths]
    heads = _checks.positive_int(heads, "heads")
    dim = _checks.positive_int(dim, "dim")
    batch = _checks.positive_int(batch, "batch")
    repeats = _checks.positive_int(repeats, "repeats")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes: expected some of {MODES}, got {m!r}")
    impls = list(impls)
    for i in impls:
        if i not in IMPLS:
            raise ValueError(f"impls: expected some of {IMPLS}, got {i!r}")
    torch = None
    if "torch" in impls:
        try:
            import torch
        except ImportError:
            impls.remove("torch")
    gemms = _check_gemms(gemms)
    labels = _labels(impls, gemms)
    with _thread_counts(threads, torch) as threads:
        size = 2048 if max(lengths) >= 1024 else 512                  # small sweeps: a quick estimate
        rate = matmul_rate(threads, size)
        providers = gemm_info(threads, gemms, size)
        rows = []
        cells = [(m, n) for m in modes for n in lengths]
        bar = progress_bar(len(cells) * len(labels), progress)
        for mode, n in cells:
            rng = np.random.default_rng(n)
            q, k, v, go = (rng.standard_normal((batch, heads, n, dim), dtype=np.float32) for _ in range(4))
            calls = _cell_calls(labels, mode, q, k, v, go, threads, batch * heads * n * n, reference_max_bytes)
            times = _interleaved(calls, repeats, threads)
            mem = {}
            if memory:
                for label, impl, g in labels:
                    if label in calls:
                        mem[label] = memory_in_fresh_process(impl, mode, n, heads=heads, dim=dim, batch=batch,
                                                             threads=threads, gemm=g)
            work = flops(mode, batch, heads, n, dim)
            rows += _cell_rows(labels, calls, times, mem, mode, n, work, rate, providers, bar)
        if bar is not None:
            bar.close()
    return {
        "machine": _machine(threads, rate, torch, providers),
        "config": dict(batch=batch, heads=heads, dim=dim, dtype="float32", repeats=repeats, lengths=lengths,
                       modes=list(modes), impls=impls, threads=threads, gemms=gemms,
                       memory="peak RSS growth of one call, fresh process" if memory else None),
        "rows": rows,
    }


def _labels(impls, gemms) -> list:
    """The rows of :func:`run`: (label, impl, provider); the tiled engine once per provider."""
    labels = []
    for impl in impls:
        if impl == "tiled":
            labels += [("tiled" if len(gemms) == 1 else f"tiled ({g})", impl, g) for g in gemms]
        else:
            labels.append((impl, impl, None))
    return labels


def _cell_calls(labels, mode, q, k, v, go, threads, scores, reference_max_bytes) -> dict:
    """One cell's calls by label, each run once (warm-up); the reference left out where its ``scores``
    (B·H·N² elements, about four temporaries of them) would not fit in ``reference_max_bytes``."""
    calls = {}
    for label, impl, g in labels:
        fn = _make_calls(impl, mode, q, k, v, go, threads)
        if impl == "reference" and 4 * 4 * scores > reference_max_bytes:
            fn = None                                     # would not fit in memory
        if fn is not None and g is not None:
            fn = _with_gemm(g, fn)
        if fn is not None:
            with _blas_threads(threads) if impl == "reference" else contextlib.nullcontext():
                fn()                                      # warm-up
            calls[label] = fn
    return calls


def _interleaved(calls, repeats: int, threads: int) -> dict:
    """The times of ``repeats`` turns of each call, interleaved: noise hits all alike."""
    times = {label: [] for label in calls}
    for _ in range(repeats):
        for label, fn in calls.items():
            time.sleep(SETTLE_S)
            with _blas_threads(threads) if label == "reference" else contextlib.nullcontext():
                fn()                                      # untimed: back to a warm steady state
                t = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t)
    return times


def _cell_rows(labels, calls, times, mem, mode, n, work, rate, providers, bar) -> list:
    """One cell's rows of :func:`run`, a row for each label (empty where it did not run)."""
    rows = []
    torch_t = statistics.median(times["torch"]) if "torch" in times else None
    for label, impl, g in labels:
        if bar is not None:
            bar.update(1)
        if label not in calls:
            rows.append(dict(mode=mode, n=n, impl=label, gemm=g, median_s=None, gflops=None,
                             pct_matmul=None, peak_mb=None, ratio_torch=None, times_s=[]))
            continue
        t = statistics.median(times[label])
        gf = work / t / 1e9
        base = providers[g]["matmul_gflops"] if g is not None else rate
        rows.append(dict(mode=mode, n=n, impl=label, gemm=g, median_s=t, gflops=gf,
                         pct_matmul=100 * gf / base,
                         peak_mb=mem[label] / 2**20 if mem.get(label) is not None else None,
                         ratio_torch=None if torch_t is None else t / torch_t, times_s=times[label]))
    return rows


def _with_gemm(name: str, fn):
    """``fn`` run with the GEMM provider ``name`` (a :func:`qkv.config` block around each call: providers take
    turns, and nothing of the process is changed)."""
    from qkv.engine.backends.configuration import config

    def call():
        with config(gemm=name):
            return fn()
    return call


def long_sequence(n: int = 65536, *, heads: int = 1, dim: int = 64, threads: int | None = None) -> dict:
    """Run one tiled forward of length ``n`` in a fresh process; its peak RSS and time.

    The peak is the child's VmHWM (its own address space since exec), not ``ru_maxrss``, which on Linux
    starts from the RSS of the parent at fork time.
    """
    return _fresh_forward(
        f"n, h, e, th = {n}, {heads}, {dim}, {threads!r}\n",
        "t = time.perf_counter(); out = qkv.scaled_dot_product_attention(q, k, v, backend='tiled')\n"
        "t = time.perf_counter() - t\n",
        "dict(n=n, heads=h, dim=e, seconds=t, peak_rss_mb=rss / 2**20, "
        "scores_would_take_mb=h * n * n * 4 / 2**20, finite=bool(np.isfinite(out).all()))", "long-sequence run")


def _fresh_forward(params: str, timed: str, report: str, what: str) -> dict:
    """A forward in a fresh Python: ``params`` (n, h, e, th and the like, as code), random q, k, v (1, h, n, e)
    float32, ``timed`` (code leaving ``t`` and ``out``), then the JSON of ``report`` (an expression that may
    use ``rss``, the child's VmHWM in bytes). Raises RuntimeError naming ``what`` with the child's last line
    when it fails."""
    code = ("import time, json, numpy as np, qkv\n"
            "from qkv import backends, mods\n"
            "from qkv.tools.bench._measure import _read_status\n"
            "from qkv.core.blockmask import create_block_mask\n"
            + params +
            "qkv.set_num_threads(th)\n"
            "r = np.random.default_rng(0)\n"
            "q, k, v = (r.standard_normal((1, h, n, e), dtype=np.float32) for _ in range(3))\n"
            + timed +
            "rss = _read_status('VmHWM')\n"
            f"print(json.dumps({report}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
