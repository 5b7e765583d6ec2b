"""The tiled engine against its own GEMMs (:func:`qkv.bench.gemm_share`), and torch's SDPA against ``torch.mm``."""
from __future__ import annotations

import time

import numpy as np

from qkv.tools.bench._measure import _best_time, _check_gemms, flops
from qkv.tools.bench._sweep import MODES


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
    from qkv.compute import gemm
    from qkv.engine.backends import tiled
    from qkv.engine.backends.configuration import config
    gemms = _check_gemms(gemms)
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, heads, n, dim), dtype=np.float32) for _ in range(3))
    go = rng.standard_normal((1, heads, n, dim), dtype=np.float32)
    modes = tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes: expected some of {', '.join(MODES)}, got {bad[0]!r}")
    rows = []
    for g in gemms:
        with config(gemm=g):                                    # the provider for this row only
            p = gemm.GEMM.active()
            # every provider a product may go to: the chosen one, and NumPy, which keeps the small products
            # where auto took MKL (gemm.AUTO_RESOLVE_FLOPS)
            numpy_p = gemm.GEMM.provider("numpy")
            provs = [p] if p is numpy_p else [p, numpy_p]
            acc = {}
            timers = _gemm_timers(provs, acc)
            for mode in modes:
                if mode == "backward":                               # gradients, the forward included
                    def call():
                        tiled.backward(go, q, k, v, scale=dim ** -0.5, threads=1)
                else:
                    def call(causal=mode == "causal"):
                        tiled.forward(q, k, v, scale=dim ** -0.5, is_causal=causal, threads=1)
                wall, total, in_gemm, gflop = _best_share(call, p, provs, timers, acc, repeats)
                nominal = flops(mode, 1, heads, n, dim)
                rate = gflop / in_gemm / 1e9
                rows.append(dict(gemm=g, mode=mode, n=n, heads=heads, cpu_s=total, wall_s=wall, gemm_s=in_gemm,
                                 gemm_gflops=rate, gflops=nominal / wall / 1e9,
                                 share=(nominal / wall / 1e9) / rate))
    if torch_sdpa is None or torch_sdpa:
        try:
            import torch  # noqa: F401
        except ImportError:
            if torch_sdpa:
                raise ValueError("torch_sdpa: needs torch (pip install 'qkv[torch]')") from None
        else:
            rows += _torch_share(q, k, v, modes, repeats)
    return rows


def _gemm_timers(provs, acc: dict) -> list:
    """For each provider in ``provs``, its ``matmul`` wrapped to add its time and flops to ``acc``."""
    def timer(real):
        def timed(a, b, out=None):
            t = time.perf_counter()
            r = real(a, b, out=out)
            acc["s"] += time.perf_counter() - t
            acc["flops"] += 2 * np.size(a) * (np.shape(b)[-1] if np.ndim(b) > 1 else 1)
            return r
        return timed
    return [timer(x.matmul) for x in provs]


def _best_share(call, p, provs, timers, acc: dict, repeats: int) -> tuple:
    """The repeat of ``call`` with the least wall time, on one BLAS thread, after a warm-up: ``(wall, cpu,
    seconds in GEMMs, their flops)``, the providers' matmuls timed by ``timers`` and the compiled loop's by
    ``p.clock``."""
    from qkv.engine.backends.runtime import RUNTIME
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
    return best



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
