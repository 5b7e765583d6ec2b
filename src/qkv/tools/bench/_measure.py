"""The measurements under :mod:`qkv.bench`: nominal flops, matmul rates, the CPU's name, peak memory (here
or in a fresh process), the calls being timed and the progress bar."""
from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import subprocess
import sys
import time

import numpy as np


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
    from qkv.compute import gemm
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
    from qkv.compute import gemm
    chosen = {g: gemm.GEMM.auto_choice() if g == "auto" else (g, g) for g in gemms}
    rates = provider_rates(threads, sorted({name for name, _ in chosen.values()}), n)
    return {g: dict(gemm=name, exp=exp, kernel=gemm.GEMM.provider(name).kernel(), matmul_gflops=rates[name])
            for g, (name, exp) in chosen.items()}


def provider_rates(threads: int, names, n: int = 2048, repeats: int = 7) -> dict:
    """The float32 matmul rate (GFLOP/s) of each GEMM provider on ``threads`` threads, the providers taking
    turns, best of ``repeats`` (a shared machine's load only ever slows a sample down)."""
    from qkv.compute import gemm
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
    from qkv.compute import gemm
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


@contextlib.contextmanager
def _thread_counts(threads, torch):
    """One thread count for qkv and torch (None: qkv's own), yielded resolved; qkv's a :func:`qkv.config`
    block (nothing of the process changed), torch's restored on leaving."""
    from qkv.engine.backends.configuration import config
    from qkv.engine.api import get_num_threads
    with config(threads=threads):
        threads = get_num_threads()
        old_torch = torch.get_num_threads() if torch is not None else None
        if torch is not None:
            torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            if torch is not None:
                torch.set_num_threads(old_torch)


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
    code = ("import json, sys; from qkv.tools.bench._measure import _child_memory; "
            f"print(json.dumps(_child_memory({impl!r}, {mode!r}, {n}, {heads}, {dim}, {batch}, {threads}, "
            f"{gemm!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def _child_memory(impl, mode, n, heads, dim, batch, threads, gemm=None):
    from qkv.engine.api import set_num_threads
    from qkv.compute.gemm import set_gemm
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
    from qkv.engine.api import scaled_dot_product_attention_backward
    from qkv.engine.sdpa import scaled_dot_product_attention
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


def _best_time(fn, repeats: int) -> float:
    """The least time (``time.perf_counter``, as :func:`gemm_share`'s) of ``repeats`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="qkv bench", unit="run", leave=False, file=sys.stderr)
