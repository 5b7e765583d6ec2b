"""Side-by-side benchmark of the engine: qkv tiled, qkv reference, torch SDPA, in one run.

For each mode (``forward``, ``causal`` forward, ``backward`` = gradients from ``grad_out``) and sequence length
N, the implementations run *interleaved* (a turn of each, repeated; a turn is a short pause, an untimed
call and a timed one) so that a noisy machine slows them alike; the table reports the median. Used by ``qkv bench`` and ``benchmarks/bench_engine.py``.

Columns: median seconds; GFLOP/s of the nominal matmul work (forward ``4·B·H·N²·E``, halved for causal;
backward ``14·B·H·N²·E``: the forward's 2 matmuls plus the backward's 5, as FlashAttention counts them);
that rate as a % of this machine's NumPy float32 matmul rate measured in the same run with the same
thread count; peak memory (growth of the peak RSS during one call, in a fresh process per cell, read from
/proc after resetting the peak; tracemalloc where /proc is missing); time relative to torch.

The GEMM provider (:mod:`qkv.gemm`): the header names the one in use, the CPU model and each provider's BLAS
kernel and measured matmul rate; ``gemms=("numpy", "mkl")`` runs the tiled engine once per provider, side by
side in the same turns (rows ``tiled (numpy)``, ``tiled (mkl)``), each row's "% matmul" against its own
provider's rate.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

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


def flops(mode: str, batch: int, heads: int, n: int, dim: int) -> float:
    """Nominal floating-point operations of one call (see the module docstring)."""
    pairs = n * n if mode != "causal" else n * (n + 1) / 2
    per_pair = 14 * dim if mode == "backward" else 4 * dim
    return batch * heads * pairs * per_pair


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_rate(threads: int, n: int = 2048, repeats: int = 5, provider: str = "numpy") -> float:
    """This machine's float32 matmul rate (GFLOP/s) of an (n × n)·(n × n) product on ``threads`` BLAS threads,
    by the GEMM ``provider`` (``"numpy"``: NumPy's BLAS; ``"mkl"``: MKL through :mod:`qkv.gemm`)."""
    from . import gemm
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    p = gemm.GEMM.provider(provider)
    with _blas_threads(threads) if provider == "numpy" else p.threads(threads):
        p.matmul(a, b, out=c)
        t = _median_time(lambda: p.matmul(a, b, out=c), repeats)
    return 2 * n ** 3 / t / 1e9


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name with its family, model and widest vector unit, as ``/proc/cpuinfo`` has them —
    ``AMD EPYC (family 25 model 17, AVX-512)`` — since a virtual machine often names only the brand, and the
    same name covers CPUs as different as Zen 3 (AVX2) and Zen 4 (AVX-512); else what ``platform`` says."""
    info = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():                      # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                info.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    name = info.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "unknown"
    flags = set(info.get("flags", "").split())
    extra = []
    if info.get("cpu family") and info.get("model"):
        extra.append(f"family {info['cpu family']} model {info['model']}")
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "NEON" if "asimd" in flags else None
    if isa:
        extra.append(isa)
    return f"{name} ({', '.join(extra)})" if extra else name


def gemm_info(threads: int, gemms, n: int = 2048) -> dict:
    """Per GEMM choice (``numpy``, ``mkl``, ``auto``): its BLAS kernel, exp provider and matmul rate on
    ``threads`` threads (``n`` × ``n`` float32)."""
    from . import gemm
    chosen = {g: gemm.GEMM.auto_choice() if g == "auto" else (g, g) for g in gemms}
    rates = provider_rates(threads, sorted({name for name, _ in chosen.values()}), n)
    return {g: dict(gemm=name, exp=exp, kernel=gemm.GEMM.provider(name).kernel(), matmul_gflops=rates[name])
            for g, (name, exp) in chosen.items()}


def provider_rates(threads: int, names, n: int = 2048, repeats: int = 7) -> dict:
    """The float32 matmul rate (GFLOP/s) of each GEMM provider on ``threads`` threads, the providers taking
    turns, best of ``repeats`` (a shared machine's load only ever slows a sample down)."""
    from . import gemm
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    best = dict.fromkeys(names, math.inf)
    for _ in range(repeats):
        for name in names:
            p = gemm.GEMM.provider(name)
            with _blas_threads(threads) if name == "numpy" else p.threads(threads):
                p.matmul(a, b, out=c)
                t = time.perf_counter()
                p.matmul(a, b, out=c)
                best[name] = min(best[name], time.perf_counter() - t)
    return {name: 2 * n ** 3 / t / 1e9 for name, t in best.items()}


def _check_gemms(gemms) -> list:
    """The GEMM choices asked for (None: the current one), validated; ValueError for unknown or missing ones."""
    from . import gemm
    if gemms is None:
        return [gemm.GEMM.choice]
    if not gemms:
        raise ValueError("gemms: expected at least one of ('auto', 'numpy', 'mkl'), got none")
    for g in gemms:
        if g != "auto":
            gemm.GEMM.provider(g)                  # ValueError: unknown, or mkl without its extra
    return list(dict.fromkeys(gemms))


@contextlib.contextmanager
def _blas_threads(n: int):
    try:
        import threadpoolctl
    except ImportError:
        yield
        return
    with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
        yield


def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_memory(fn) -> tuple[float, str]:
    """Bytes by which one call of ``fn`` raised the process's peak memory, and how it was measured."""
    rss = _read_status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:        # reset VmHWM to the current RSS
            f.write("5")
        reset = True
    except OSError:
        reset = False
    if rss is not None and reset:
        fn()
        hwm = _read_status("VmHWM")
        return float(max(0, hwm - rss)), "rss"
    import tracemalloc
    tracemalloc.start()
    try:
        fn()
        return float(tracemalloc.get_traced_memory()[1]), "tracemalloc"
    finally:
        tracemalloc.stop()


def memory_in_fresh_process(impl: str, mode: str, n: int, *, heads: int, dim: int, batch: int,
                            threads: int, gemm: str | None = None) -> float | None:
    """Peak-RSS growth (bytes) of one call, measured in a fresh Python process (so that memory another
    implementation freed earlier cannot hide it): inputs are made, the peak is reset, the call runs."""
    code = ("import json, sys; from qkv import bench; "
            f"print(json.dumps(bench._child_memory({impl!r}, {mode!r}, {n}, {heads}, {dim}, {batch}, {threads}, "
            f"{gemm!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def _child_memory(impl, mode, n, heads, dim, batch, threads, gemm=None):
    from qkv.engine import set_num_threads
    from qkv.gemm import set_gemm
    set_num_threads(threads)
    if gemm is not None:
        set_gemm(gemm)
    if impl == "torch":
        import torch
        torch.set_num_threads(threads)
    rng = np.random.default_rng(n)
    q, k, v, go = (rng.standard_normal((batch, heads, n, dim), dtype=np.float32) for _ in range(4))
    fn = _make_calls(impl, mode, q, k, v, go, threads)
    with _blas_threads(threads) if impl == "reference" else contextlib.nullcontext():
        return peak_memory(fn)[0]


def _make_calls(impl, mode, q, k, v, go, threads):
    """A zero-argument callable running ``impl`` in ``mode``; None when the combination is not offered."""
    from qkv.engine import scaled_dot_product_attention_backward
    from qkv.sdpa import scaled_dot_product_attention
    causal = mode == "causal"
    if impl in ("tiled", "reference"):
        if mode == "backward":
            if impl == "reference":
                return None
            return lambda: scaled_dot_product_attention_backward(go, q, k, v)
        return lambda: scaled_dot_product_attention(q, k, v, is_causal=causal, backend=impl)
    import torch
    F = torch.nn.functional
    tq, tk, tv, tgo = (torch.from_numpy(a) for a in (q, k, v, go))
    if mode == "backward":
        tq, tk, tv = (t.clone().requires_grad_() for t in (tq, tk, tv))

        def run():
            tq.grad = tk.grad = tv.grad = None
            F.scaled_dot_product_attention(tq, tk, tv).backward(tgo)
        return run
    return lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)


def run(lengths=(512, 1024, 2048, 4096), *, heads: int = 8, dim: int = 64, batch: int = 1, repeats: int = 5,
        threads: int | None = None, modes=MODES, impls=IMPLS, memory: bool = True, progress: bool = True,
        reference_max_bytes: int = REFERENCE_MAX_BYTES, gemms=None) -> dict:
    """Run the sweep; returns a JSON-ready dict ``{"machine", "config", "rows"}`` (see README, *Engine*).

    ``gemms``: the GEMM providers to run the tiled engine with, side by side (``("numpy", "mkl")``); None:
    the one in use (:func:`qkv.get_gemm`). Each row has ``gemm``: its provider (None for reference/torch).
    """
    from qkv.engine import get_num_threads, set_num_threads
    from qkv import _checks, gemm

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
    from qkv.backends.runtime import RUNTIME
    saved_gemm = gemm.GEMM.choice
    gemms = _check_gemms(gemms)
    # the rows: (label, impl, provider); the tiled engine once per provider
    labels = []
    for impl in impls:
        if impl == "tiled":
            labels += [("tiled" if len(gemms) == 1 else f"tiled ({g})", impl, g) for g in gemms]
        else:
            labels.append((impl, impl, None))
    saved_threads = RUNTIME.threads
    if threads is not None:
        set_num_threads(threads)
    threads = get_num_threads()
    old_torch_threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(threads)
    try:
        size = 2048 if max(lengths) >= 1024 else 512                  # small sweeps: a quick estimate
        rate = matmul_rate(threads, size)
        providers = gemm_info(threads, gemms, size)
        rows = []
        cells = [(m, n) for m in modes for n in lengths]
        bar = _progress(len(cells) * len(labels), progress)
        for mode, n in cells:
            rng = np.random.default_rng(n)
            q, k, v, go = (rng.standard_normal((batch, heads, n, dim), dtype=np.float32) for _ in range(4))
            calls = {}
            for label, impl, g in labels:
                fn = _make_calls(impl, mode, q, k, v, go, threads)
                if impl == "reference" and 4 * 4 * batch * heads * n * n > reference_max_bytes:
                    fn = None                                     # would not fit in memory
                if fn is not None and g is not None:
                    fn = _with_gemm(g, fn)
                if fn is not None:
                    with _blas_threads(threads) if impl == "reference" else contextlib.nullcontext():
                        fn()                                      # warm-up
                    calls[label] = fn
            times = {label: [] for label in calls}
            for _ in range(repeats):                              # interleaved: noise hits all alike
                for label, fn in calls.items():
                    time.sleep(SETTLE_S)
                    with _blas_threads(threads) if label == "reference" else contextlib.nullcontext():
                        fn()                                      # untimed: back to a warm steady state
                        t = time.perf_counter()
                        fn()
                        times[label].append(time.perf_counter() - t)
            mem = {}
            if memory:
                for label, impl, g in labels:
                    if label in calls:
                        mem[label] = memory_in_fresh_process(impl, mode, n, heads=heads, dim=dim, batch=batch,
                                                             threads=threads, gemm=g)
            work = flops(mode, batch, heads, n, dim)
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
        if bar is not None:
            bar.close()
    finally:
        set_num_threads(saved_threads)
        gemm.set_gemm(saved_gemm)
        if torch is not None:
            torch.set_num_threads(old_torch_threads)
    return {
        "machine": _machine(threads, rate, torch, providers),
        "config": dict(batch=batch, heads=heads, dim=dim, dtype="float32", repeats=repeats, lengths=lengths,
                       modes=list(modes), impls=impls, threads=threads, gemms=gemms,
                       memory="peak RSS growth of one call, fresh process" if memory else None),
        "rows": rows,
    }


def _with_gemm(name: str, fn):
    """``fn`` run with the GEMM provider ``name`` (set before each call: providers take turns)."""
    from . import gemm

    def call():
        gemm.set_gemm(name)
        return fn()
    return call


def gemm_share(n: int = 4096, *, heads: int = 2, dim: int = 64, gemms=None, repeats: int = 3,
               modes=("forward", "causal"), torch_sdpa=None) -> list:
    """The tiled forward against its own GEMMs, on one thread: per provider and mode, the time of the call,
    the time inside the provider's matmuls (each timed), their rate, and the forward's nominal rate as a share
    of that rate — how close the engine runs to its GEMM (1.0: nothing but matmuls). One clock for all: the
    monotonic one (``time.perf_counter``; :data:`qkv.kernels.GEMM_CLOCK` inside the compiled loop), read in user
    space — the thread's CPU clock, which this used to read around every GEMM, is a system call, and its ~1,200
    reads made a causal forward 2–3 % slower: the share measured its own timer. The repeat of ``repeats`` with
    the least time is kept (the one other jobs on a shared machine took least from; its CPU time too, as
    ``cpu_s``). ``modes``: of ``forward``, ``causal`` and ``backward`` (the gradients, forward included, as
    :func:`flops` counts them: ``tiled.backward`` without ``out``/``lse``; torch: autograd through SDPA).

    ``torch_sdpa`` (None: when torch is installed): also torch's SDPA on the same inputs and thread, rows with
    ``gemm="torch"``, against torch's own GEMM (``torch.mm``, one thread) on its CPU flash kernel's block shapes
    (:func:`torch_flash_blocks`), timed apart — its matmuls cannot be timed inside the fused kernel, and a
    GEMM alone runs at least as fast as inside the kernel, so that share is if anything low (``gemm_s`` None)."""
    from . import gemm
    from .backends import tiled
    from .backends.runtime import RUNTIME
    saved = gemm.GEMM.choice
    gemms = _check_gemms(gemms)
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, heads, n, dim), dtype=np.float32) for _ in range(3))
    go = rng.standard_normal((1, heads, n, dim), dtype=np.float32)
    modes = tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes: expected some of {', '.join(MODES)}, got {bad[0]!r}")
    rows = []
    try:
        for g in gemms:
            gemm.set_gemm(g)
            p = gemm.GEMM.active()
            # every provider a product may go to: the chosen one, and NumPy, which keeps the small products
            # where auto took MKL (gemm.AUTO_RESOLVE_FLOPS)
            numpy_p = gemm.GEMM.provider("numpy")
            provs = [p] if p is numpy_p else [p, numpy_p]
            acc = {}

            def timer(real):
                def timed(a, b, out=None):
                    t = time.perf_counter()
                    r = real(a, b, out=out)
                    acc["s"] += time.perf_counter() - t
                    acc["flops"] += 2 * np.size(a) * (np.shape(b)[-1] if np.ndim(b) > 1 else 1)
                    return r
                return timed
            timers = [timer(x.matmul) for x in provs]
            for mode in modes:
                if mode == "backward":                               # gradients, the forward included
                    def call():
                        tiled.backward(go, q, k, v, scale=dim ** -0.5, threads=1)
                else:
                    def call(causal=mode == "causal"):
                        tiled.forward(q, k, v, scale=dim ** -0.5, is_causal=causal, threads=1)
                best = None
                with RUNTIME.blas_single_threaded():
                    call()                                           # warm-up
                    for _ in range(repeats):
                        acc.update(s=0.0, flops=0.0)
                        for x, timed in zip(provs, timers):
                            x.matmul = timed
                        p.clock = clock = np.zeros(2)                # the compiled loop's GEMMs (qkv.kernels)
                        try:
                            t, w = time.thread_time(), time.perf_counter()
                            call()
                            total, wall = time.thread_time() - t, time.perf_counter() - w
                        finally:
                            for x in provs:
                                del x.matmul                         # the class's method again
                            p.clock = None
                        acc["s"] += clock[0]
                        acc["flops"] += clock[1]
                        if best is None or wall < best[0]:
                            best = (wall, total, acc["s"], acc["flops"])
                wall, total, in_gemm, gflop = best
                nominal = flops(mode, 1, heads, n, dim)
                rate = gflop / in_gemm / 1e9
                rows.append(dict(gemm=g, mode=mode, n=n, heads=heads, cpu_s=total, wall_s=wall, gemm_s=in_gemm,
                                 gemm_gflops=rate, gflops=nominal / wall / 1e9,
                                 share=(nominal / wall / 1e9) / rate))
    finally:
        gemm.set_gemm(saved)
    if torch_sdpa is None or torch_sdpa:
        try:
            import torch  # noqa: F401
        except ImportError:
            if torch_sdpa:
                raise ValueError("torch_sdpa: needs torch (pip install 'qkv[torch]')") from None
        else:
            rows += _torch_share(q, k, v, modes, repeats)
    return rows


def torch_flash_blocks(n: int) -> tuple:
    """The (query, key) block of torch's CPU flash attention for ``n`` query rows (float32, no mask): 256 rows
    from 768 queries on, 64 from 192, else 32; 512 keys — ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``
    (torch 2.x), capped at ``n``."""
    q = 256 if n >= 768 else 64 if n >= 192 else 32
    return min(q, n), min(512, n)


def _torch_share(q, k, v, modes, repeats: int) -> list:
    """:func:`gemm_share`'s torch rows: SDPA at one thread, against ``torch.mm`` on its kernel's blocks."""
    import torch
    F = torch.nn.functional
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, heads, n, dim = q.shape
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        bq, bk = torch_flash_blocks(n)
        a, kb, vb = (torch.from_numpy(x[0, 0, :m].copy()) for x, m in ((q, bq), (k, bk), (v, bk)))
        pm = torch.randn(bq, bk)                               # a block of probabilities' shape
        s_out, o_out = torch.empty(bq, bk), torch.empty(bq, dim)

        def mms():                                             # Q·Kᵀ (K as stored: a transposed view) and P·V
            torch.mm(a, kb.t(), out=s_out)
            torch.mm(pm, vb, out=o_out)
        reps = max(1, int(2e9 // (4 * bq * bk * dim)))          # ≈ 20 ms a sample
        mm_t = _best_time(lambda: [mms() for _ in range(reps)], repeats)
        rate = 4 * bq * bk * dim * reps / mm_t / 1e9
        rows = []
        for mode in modes:
            causal = mode == "causal"
            if mode == "backward":                             # autograd's gradients, the forward included
                gq, gk, gv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))
                tgo = torch.ones_like(tq)

                def fn():
                    F.scaled_dot_product_attention(gq, gk, gv).backward(tgo)
            else:
                fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)   # noqa: E731
            fn()                                               # warm-up
            total = _best_time(fn, repeats)
            nominal = flops(mode, 1, heads, n, dim)
            rows.append(dict(gemm="torch", mode=mode, n=n, heads=heads, cpu_s=None, wall_s=total, gemm_s=None,
                             gemm_gflops=rate, gflops=nominal / total / 1e9, share=(nominal / total / 1e9) / rate,
                             blocks=(bq, bk)))
        return rows
    finally:
        torch.set_num_threads(old)


def _best_time(fn, repeats: int) -> float:
    """The least time (``time.perf_counter``, as :func:`gemm_share`'s) of ``repeats`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_share_lines(rows) -> list:
    """Plain lines (also Markdown-table rows) of :func:`gemm_share`."""
    out = ["| GEMM | mode | N | ms | in GEMM ms | GEMM GFLOP/s | forward GFLOP/s | share of GEMM rate |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        in_gemm = "—" if r["gemm_s"] is None else f"{r['gemm_s'] * 1e3:.0f}"
        name = r["gemm"] if r["gemm"] != "torch" else "torch SDPA (its mm, %d×%d blocks)" % r["blocks"]
        out.append(f"| {name} | {r['mode']} | {r['n']} | {r['wall_s'] * 1e3:.0f} | {in_gemm} | "
                   f"{r['gemm_gflops']:.0f} | {r['gflops']:.0f} | {100 * r['share']:.0f} % |")
    return out


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="qkv bench", unit="run", leave=False, file=sys.stderr)


def _kernels_in_use() -> str:
    """The engine's block kernels (:mod:`qkv.kernels`): ``numba 0.68.1`` or ``numpy``."""
    from . import kernels
    try:
        return kernels.KERNELS.describe()
    except ValueError:                                  # QKV_KERNELS=numba without numba: the run says so
        return "numpy"


def _plain_loop_in_use() -> bool:
    """Whether the engine's plain blocks run as its compiled loop (``qkv.backends.tiled.current_limits().plain_loop``: numba
    and the GEMM provider's C sgemm there), as benchmark headers say (``…, compiled loop``)."""
    from . import gemm, kernels
    from .backends import tiled
    if _kernels_in_use() == "numpy" or not tiled.current_limits().plain_loop:
        return False
    return kernels.plain_available(gemm.GEMM.active())


def _kernels_line() -> str:
    """``numba 0.68.1, compiled loop``, ``numba 0.68.1`` or ``numpy``."""
    return _kernels_in_use() + (", compiled loop" if _plain_loop_in_use() else "")


def _machine(threads, rate, torch, providers=None) -> dict:
    """What ran where: CPU, NumPy's BLAS and its rate (``blas``, ``matmul_gflops``), the GEMM provider in
    use (``gemm``) and, per provider measured, its kernel and rate (``gemms``)."""
    from . import gemm
    return dict(cpu=cpu_model(), cpus=os.cpu_count(), threads=threads, python=platform.python_version(),
                numpy=np.__version__, blas=gemm.NumpyGemm.kernel(), openblas_coretype=os.environ.get("OPENBLAS_CORETYPE"),
                torch=None if torch is None else torch.__version__, matmul_gflops=rate,
                gemm=gemm.get_gemm(), gemms=providers or {}, kernels=_kernels_in_use(),
                plain_loop=_plain_loop_in_use(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def environment_line() -> str:
    """What a benchmark script's figures ran on, for its first line: the CPU (:func:`cpu_model`), NumPy's BLAS
    and kernel, the GEMM provider in use and the engine's block kernels (and its compiled loop) —
    ``CPU AMD EPYC (family 25 model 17, AVX-512); numpy 2.4.6 (openblas 0.3.31 (SkylakeX)); GEMM numpy;
    block kernels numba 0.68.1, compiled loop``."""
    from . import gemm
    return (f"CPU {cpu_model()}; numpy {np.__version__} ({gemm.NumpyGemm.kernel()}); GEMM {gemm.get_gemm()}; "
            f"block kernels {_kernels_line()}")


def header(result: dict) -> str:
    """The line above a table: shape, threads, repeats, CPU, the GEMM provider(s) with kernel and rate, the
    engine's block kernels (:mod:`qkv.kernels`)."""
    m, c = result["machine"], result["config"]
    provs = m.get("gemms") or {"numpy": dict(kernel=m["blas"], matmul_gflops=m["matmul_gflops"])}
    parts = []
    for g, p in provs.items():
        what = f"{g}" if p.get("gemm", g) == g else f"{g} (GEMM {p['gemm']}, exp {p['exp']})"
        parts.append(f"{what} matmul {p['matmul_gflops']:.0f} GFLOP/s ({p['kernel']})")
    torch_part = f"; torch {m['torch']}" if m.get("torch") else ""
    return (f"B={c.get('batch', 1)} H={c['heads']} E={c['dim']} float32, {c['threads']} threads, median of "
            f"{c['repeats']}; CPU {m.get('cpu', '?')}; GEMM {m.get('gemm', 'numpy')} in use; "
            f"block kernels {m.get('kernels', 'numpy')}{', compiled loop' if m.get('plain_loop') else ''}; "
            f"{'; '.join(parts)}{torch_part}; {m['date']}")


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
            "from qkv import bench, backends, mods\n"
            "from qkv.blockmask import create_block_mask\n"
            + params +
            "qkv.set_num_threads(th)\n"
            "r = np.random.default_rng(0)\n"
            "q, k, v = (r.standard_normal((1, h, n, e), dtype=np.float32) for _ in range(3))\n"
            + timed +
            "rss = bench._read_status('VmHWM')\n"
            f"print(json.dumps({report}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


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


HEADERS = ["mode", "N", "impl", "median ms", "GFLOP/s", "% matmul", "peak MB", "× torch"]


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
    from ._files import atomic_write
    fmt = os.path.splitext(os.fspath(path))[1].lower().lstrip(".") or "png"
    with atomic_write(path, "wb") as fh:                 # whole or not at all
        fig.savefig(fh, format=fmt, dpi=120)
    plt.close(fig)


def dumps(result: dict) -> str:
    return json.dumps(result, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)


# ---------------------------------------------------------------------------------------------- variants
#: The attention variants' targets (qkv bench --variants): (case, ratio name, numerator, denominator, bound);
#: a bound of None: a ratio reported for what it says, no target.
VARIANT_TARGETS = (
    ("window", "window / qkv full causal", "qkv window", "qkv full causal", 0.2),
    ("window", "window / torch dense mask", "qkv window", "torch dense mask", 1.0),
    ("window", "full causal / full non-causal (0.5 + the diagonal's cost)", "qkv full causal",
     "qkv full non-causal", None),
    ("documents", "packed / separate", "qkv packed documents", "qkv separate calls", 1.2),
    ("mods", "ALiBi / plain", "qkv ALiBi", "qkv plain causal", 1.15),
    ("mods", "softcap / plain", "qkv softcap 50", "qkv plain causal", 1.15),
    ("mods", "RoPE / plain", "qkv RoPE", "qkv plain causal", 1.15),
    ("backward", "flex backward / torch", "qkv flex backward", "torch autograd dense mask", 1.5),
)
#: Peak RSS bound of the long sliding-window forward, MB.
VARIANT_LONG_MB = 2048


def _variant_cases(heads, dim, window_n, window, docs, doc_len, mods_n, backward_n, torch):
    """The cases of :func:`variants`: ``(case, N, {impl: zero-argument callable}, note)``, built lazily so
    that only one case's inputs live at a time."""
    from . import backends, mods, positions
    from .blockmask import create_block_mask
    tiled = backends.get("tiled")
    scale = 1 / math.sqrt(dim)

    def inputs(n, k=3):
        rng = np.random.default_rng(n)
        return [rng.standard_normal((1, heads, n, dim), dtype=np.float32) for _ in range(k)]

    def window_case():
        n = window_n
        q, k, v = inputs(n)
        bm = create_block_mask(mods.sliding_window(window), None, None, n, n)
        calls = {"qkv window": lambda: tiled.forward(q, k, v, scale=scale, block_mask=bm),
                 "qkv full causal": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True),
                 "qkv full non-causal": lambda: tiled.forward(q, k, v, scale=scale)}
        if torch is not None:
            F = torch.nn.functional
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            dense = torch.from_numpy(np.array(np.broadcast_to(bm.dense((1, 1), n, n), (n, n))))
            calls["torch dense mask"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=dense)
        return "window", n, calls, f"sliding window {window}, causal (BLOCK_SIZE 128); torch gets the same mask " \
                                   "as a dense (N, N) bool tensor"

    def documents_case():
        n = docs * doc_len
        q, k, v = inputs(n)
        bm = create_block_mask(mods.document_from_lengths([doc_len] * docs), None, None, n, n)
        parts = [tuple(np.ascontiguousarray(a[:, :, d * doc_len:(d + 1) * doc_len]) for a in (q, k, v))
                 for d in range(docs)]

        def separate():
            for a, b, c in parts:
                tiled.forward(a, b, c, scale=scale)
        return "documents", n, {"qkv packed documents": lambda: tiled.forward(q, k, v, scale=scale, block_mask=bm),
                                "qkv separate calls": separate}, \
            f"{docs} documents of {doc_len}: one call with a document block mask vs {docs} calls of N = {doc_len}"

    def mods_case():
        n = mods_n
        q, k, v = inputs(n)
        alibi = mods.alibi(mods.alibi_slopes(heads))
        cap = mods.softcap(50.0)
        calls = {"qkv plain causal": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True),
                 "qkv ALiBi": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True, score_mod=alibi),
                 "qkv softcap 50": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True, score_mod=cap)}
        note = "causal; ALiBi with the paper's slopes, softcap 50 (Gemma 2)"
        rope = getattr(positions, "rope", None)
        if rope is not None:
            calls["qkv RoPE"] = lambda: tiled.forward(rope(q), rope(k), v, scale=scale, is_causal=True)
            note += ", RoPE = qkv.positions.rope on q and k (timed) then the plain forward"
        else:
            note += "; RoPE skipped: qkv.positions.rope is not there"
        return "mods", n, calls, note

    def backward_case():
        n = backward_n
        q, k, v, go = inputs(n, 4)
        bm = create_block_mask(mods.causal(), None, None, n, n)
        calls = {"qkv flex backward": lambda: tiled.backward(go, q, k, v, scale=scale, block_mask=bm)}
        if torch is not None:
            F = torch.nn.functional
            tq, tk, tv = (torch.from_numpy(a).clone().requires_grad_() for a in (q, k, v))
            tgo = torch.from_numpy(go)
            dense = torch.from_numpy(np.array(np.broadcast_to(bm.dense((1, 1), n, n), (n, n))))

            def torch_backward():
                tq.grad = tk.grad = tv.grad = None
                F.scaled_dot_product_attention(tq, tk, tv, attn_mask=dense).backward(tgo)
            calls["torch autograd dense mask"] = torch_backward
        return "backward", n, calls, "gradients (forward included) with the causal mask mod; torch: autograd " \
                                     "through SDPA with the same mask as a dense bool tensor"

    return [window_case, documents_case, mods_case, backward_case]


def variants(*, heads: int = 8, dim: int = 64, repeats: int = 5, threads: int | None = None,
             window_n: int = 8192, window: int = 512, docs: int = 8, doc_len: int = 1024, mods_n: int = 4096,
             backward_n: int = 2048, long_n: int | None = 65536, progress: bool = True,
             cases=("window", "documents", "mods", "backward")) -> dict:
    """The attention variants side by side (``qkv bench --variants``), ratios of medians against their
    targets (:data:`VARIANT_TARGETS`); returns a JSON-ready dict ``{"machine", "config", "rows", "ratios",
    "long"}``. Same protocol as :func:`run`: implementations interleaved, each turn a pause, an untimed
    call and a timed one; one thread count for qkv and torch. Each ratio also as the median of its per-turn
    ratios ("paired": the two calls of one turn run seconds apart, so slow swings of a shared machine's load
    cancel). ``cases``: which of window, documents, mods, backward to run. ``long``: one sliding-window
    forward of ``long_n`` tokens in a fresh process, its peak RSS (None: skipped)."""
    from qkv.engine import get_num_threads, set_num_threads
    from qkv import _checks
    from qkv.backends.runtime import RUNTIME

    for name, val in (("heads", heads), ("dim", dim), ("repeats", repeats), ("window_n", window_n),
                      ("window", window), ("docs", docs), ("doc_len", doc_len), ("mods_n", mods_n),
                      ("backward_n", backward_n)):
        _checks.positive_int(val, name)
    try:
        import torch
    except ImportError:
        torch = None
    saved_threads = RUNTIME.threads
    if threads is not None:
        set_num_threads(threads)
    threads = get_num_threads()
    old_torch_threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(threads)
    rows, notes = [], {}
    try:
        rate = matmul_rate(threads, 2048)
        known = ("window", "documents", "mods", "backward")
        for c in cases:
            if c not in known:
                raise ValueError(f"cases: expected some of {','.join(known)}, got {c!r}")
        makers = _variant_cases(heads, dim, window_n, window, docs, doc_len, mods_n, backward_n, torch)
        makers = [m for name, m in zip(known, makers) if name in cases]
        bar = _progress(len(makers), progress)
        for make in makers:
            case, n, calls, note = make()
            notes[case] = note
            for fn in calls.values():
                fn()                                              # warm-up
            times = {impl: [] for impl in calls}
            for _ in range(repeats):                              # interleaved: noise hits all alike
                for impl, fn in calls.items():
                    time.sleep(SETTLE_S)
                    fn()                                          # untimed: back to a warm steady state
                    t = time.perf_counter()
                    fn()
                    times[impl].append(time.perf_counter() - t)
            for impl, ts in times.items():
                rows.append(dict(case=case, n=n, impl=impl, median_s=statistics.median(ts), times_s=ts))
            del calls
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    finally:
        set_num_threads(saved_threads)
        if torch is not None:
            torch.set_num_threads(old_torch_threads)
    med = {(r["case"], r["impl"]): r["median_s"] for r in rows}
    turns = {(r["case"], r["impl"]): r["times_s"] for r in rows}
    ratios = []
    for case, what, num, den, bound in VARIANT_TARGETS:
        if case not in cases:
            continue
        if (case, num) not in med or (case, den) not in med:
            ratios.append(dict(case=case, what=what, ratio=None, paired=None, target=bound, met=None))
            continue
        ratio = med[(case, num)] / med[(case, den)]
        paired = statistics.median(a / b for a, b in zip(turns[(case, num)], turns[(case, den)]))
        ratios.append(dict(case=case, what=what, ratio=ratio, paired=paired, target=bound,
                           met=None if bound is None else ratio < bound if bound == 1.0 else ratio <= bound))
    result = {"machine": _machine(threads, rate, torch),
              "config": dict(heads=heads, dim=dim, batch=1, dtype="float32", repeats=repeats, threads=threads,
                             window_n=window_n, window=window, docs=docs, doc_len=doc_len, mods_n=mods_n,
                             backward_n=backward_n, cases=list(cases)),
              "notes": notes, "rows": rows, "ratios": ratios}
    if long_n is not None:
        lg = long_window(long_n, heads=heads, dim=dim, window=window, threads=threads)
        lg["met"] = lg["peak_rss_mb"] < VARIANT_LONG_MB
        result["long"] = lg
    return result


def long_window(n: int = 65536, *, heads: int = 8, dim: int = 64, window: int = 512,
                threads: int | None = None) -> dict:
    """One sliding-window forward (the tiled engine, a block mask) of ``n`` tokens in a fresh process: its
    time and peak RSS (VmHWM: the child's own address space since exec), the inputs included."""
    return _fresh_forward(
        f"n, h, e, w, th = {n}, {heads}, {dim}, {window}, {threads!r}\n",
        "t = time.perf_counter()\n"
        "bm = create_block_mask(mods.sliding_window(w), None, None, n, n)\n"
        "out = backends.get('tiled').forward(q, k, v, scale=e ** -0.5, block_mask=bm)[0]\n"
        "t = time.perf_counter() - t\n",
        "dict(n=n, heads=h, dim=e, window=w, seconds=t, peak_rss_mb=rss / 2**20, "
        "inputs_mb=4 * q.nbytes / 2**20, scores_would_take_mb=h * n * n * 4 / 2**20, "
        "finite=bool(np.isfinite(out).all()))", "long sliding-window run")


VARIANT_HEADERS = ["variant", "N", "impl", "median ms"]


def variants_markdown(result: dict) -> str:
    """The variants' result as Markdown: the times, then the ratios against their targets (for the README)."""
    lines = [header(result), "",
             "| variant | N | impl | median ms |", "|---|---:|---|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['n']} | {r['impl']} | {r['median_s'] * 1e3:.1f} |")
    lines += ["", "| ratio of medians | measured | per-turn (median) | target | met |", "|---|---:|---:|---:|---|"]
    for r in result["ratios"]:
        got = "—" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        paired = "—" if r["paired"] is None else f"{r['paired']:.2f}×"
        op = "<" if r["target"] == 1.0 else "≤"
        target = "—" if r["target"] is None else f"{op} {r['target']:g}×"
        met = "—" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['what']} | {got} | {paired} | {target} | {met} |")
    if "long" in result:
        lg = result["long"]
        lines.append(f"| N = {lg['n']} window {lg['window']} forward, peak RSS (H = {lg['heads']}, inputs "
                     f"{lg['inputs_mb']:.0f} MB included) | {lg['peak_rss_mb']:.0f} MB | | < {VARIANT_LONG_MB} MB | "
                     f"{'yes' if lg['met'] else '**no**'} |")
    return "\n".join(lines)


def variants_text(result: dict) -> list[str]:
    """Plain-text lines of the variants' result (the CLI's table when rich is missing)."""
    out = [f"{r['case']:<10} N={r['n']:<6} {r['impl']:<28} {r['median_s'] * 1e3:9.1f} ms" for r in result["rows"]]
    for r in result["ratios"]:
        got = "—" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        got += "" if r["paired"] is None else f" (per turn {r['paired']:.2f}x)"
        target = "" if r["target"] is None else \
            f"target {'<' if r['target'] == 1.0 else '<='} {r['target']:g}x  {'met' if r['met'] else 'MISSED'}"
        out.append(f"{r['what']:<32} {got:>24}  {target}")
    if "long" in result:
        lg = result["long"]
        out.append(f"N={lg['n']} window {lg['window']} forward: {lg['seconds']:.2f} s, peak RSS "
                   f"{lg['peak_rss_mb']:.0f} MB (target < {VARIANT_LONG_MB} MB: {'met' if lg['met'] else 'MISSED'})")
    return out
