"""What a benchmark ran on (:mod:`qkv.bench`): the engine's block kernels, the machine's record, the line
naming the environment and the header above a table."""
from __future__ import annotations

import os
import platform
import time

import numpy as np

from qkv.tools.bench._measure import cpu_model


def _kernels_in_use() -> str:
    """The engine's block kernels (:mod:`qkv.kernels`): ``numba 0.68.1`` or ``numpy``."""
    from qkv.compute import kernels
    try:
        return kernels.KERNELS.describe()
    except ValueError:                                  # QKV_KERNELS=numba without numba: the run says so
        return "numpy"


def _plain_loop_in_use() -> bool:
    """Whether the engine's plain blocks run as its compiled loop (``qkv.backends.tiled.current_limits().plain_loop``: numba
    and the GEMM provider's C sgemm there), as benchmark headers say (``…, compiled loop``)."""
    from qkv.compute import gemm, kernels
    from qkv.engine.backends import tiled
    if _kernels_in_use() == "numpy" or not tiled.current_limits().plain_loop:
        return False
    return kernels.plain_available(gemm.GEMM.active())


def _kernels_line() -> str:
    """``numba 0.68.1, compiled loop``, ``numba 0.68.1`` or ``numpy``."""
    return _kernels_in_use() + (", compiled loop" if _plain_loop_in_use() else "")


def _machine(threads, rate, torch, providers=None) -> dict:
    """What ran where: CPU, NumPy's BLAS and its rate (``blas``, ``matmul_gflops``), the GEMM provider in
    use (``gemm``) and, per provider measured, its kernel and rate (``gemms``)."""
    from qkv.compute import gemm
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
    from qkv.compute import gemm
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
