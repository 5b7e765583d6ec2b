"""The engine's block kernels (qkv.kernels, numba) against NumPy's passes on one block, one thread.

    .venv/bin/python benchmarks/bench_kernels.py [--rows 1024] [--cols 512] [--rounds 3] [--repeats 15]

One float32 block of scores (standard normal × 0.3, as a shift-free block's), restored before every call;
each case is timed ``--repeats`` times per round (best), the cases taking turns for ``--rounds`` rounds, and
the range of the rounds' bests printed:

* ``exp + sums``: the kernel's ``s ← exp(s + add)`` with the row sums (the shift-free and lazy blocks);
* ``exp + sums, no clamps``: the same without the clamps (``bounded``: shift-free blocks whose scores are
  read again — weights, dropout);
* ``exp2 + sums``: the base-2 kernel of the forward's plain blocks (scores that carry log₂ e: ``s ← 2^s``);
* ``poly + exp + sums``: softcap 30 by the engine's fitted polynomial, then the same;
* ``max pass``: the running max's pass (max, shift, exp, sums per row);
* ``numpy exp``, ``numpy tanh + exp``: NumPy's own passes for the first two (without the row sums).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from qkv import kernels
from qkv.backends import tiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    jit = kernels.KERNELS.jit()
    if jit is None:
        raise SystemExit("bench_kernels: needs numba: pip install 'qkv[jit]'")
    rng = np.random.default_rng(0)
    s0 = (rng.standard_normal((a.rows, a.cols), dtype=np.float32) * 0.3)
    s = s0.copy()
    sums, add = np.empty(a.rows, np.float32), np.zeros(a.rows, np.float32)
    seen, shift, hit = np.zeros(a.rows, bool), np.empty(a.rows, np.float32), np.empty(a.rows, bool)
    poly = tiled.scoring._tanh_poly(0.5)
    coef = np.zeros(7, np.float32)
    coef[:len(poly)] = np.array(poly) * 30
    cases = {
        "exp + sums": lambda: kernels.run(jit, s, sums, ("exp", None, add, kernels.NO_MASK, 1)),
        "exp + sums, no clamps": lambda: kernels.run(jit, s, sums, ("exp", None, add, kernels.NO_MASK, 1), bounded=True),
        "exp2 + sums": lambda: kernels.run(jit, s, sums, ("exp", None, add, kernels.NO_MASK, 1), base2=True),
        "poly + exp + sums": lambda: kernels.run(jit, s, sums, ("poly", coef, add, kernels.NO_MASK, 1)),
        "max pass": lambda: kernels.run_max(jit, s, sums, ("exp", None, add, kernels.NO_MASK, 1), seen, shift, hit),
        "numpy exp": lambda: np.exp(s, out=s),
        "numpy tanh + exp": lambda: (np.tanh(s, out=s), np.exp(s, out=s)),
    }

    def best(fn) -> float:
        b = float("inf")
        for _ in range(a.repeats):
            np.copyto(s, s0)
            t = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t)
        return b * 1e3

    got = {name: [] for name in cases}
    with threadpool_limits(1):
        for fn in cases.values():
            fn()                                                  # compiled / loaded before timing
        for _ in range(a.rounds):
            for name, fn in cases.items():
                got[name].append(best(fn))
    import numba
    print(f"{a.rows} × {a.cols} float32 block, one thread, best of {a.repeats}, {a.rounds} rounds; "
          f"numba {numba.__version__}, numpy {np.__version__}")
    for name, ms in got.items():
        print(f"  {name:22s} {min(ms):.3f}–{max(ms):.3f} ms")


if __name__ == "__main__":
    main()
