"""The tiled engine on one worker against two, alternating in one run (issue 29's "every core is used").

    .venv/bin/python benchmarks/bench_workers.py [--repeats 7] [--workers 2]

Times the tiled causal forward at N = 4096 (B = 1, H = 8, E = 64, float32) and SmolLM2's prefill attention
(q (1, 9, 512, 64) over k, v (1, 3, 512, 64), causal, grouped-query) with ``threads=1`` and
``threads=--workers``, turns alternating as ``qkv bench --variants`` takes them (a pause, an untimed call, a timed
one); prints the medians and their ratio against the target (two workers at least 1.8× one). The decoder's whole
prefill: ``bench_llama.py --only scaling``.
"""
from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

import qkv
from qkv import backends
from qkv.bench._variants import _variant_times         # qkv bench --variants' turns: warm-up, pause, untimed, timed


def _cases():
    tiled = backends.get("tiled")
    rng = np.random.default_rng(4096)
    q, k, v = (rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in range(3))
    sq = rng.standard_normal((1, 9, 512, 64), dtype=np.float32)
    sk, sv = (rng.standard_normal((1, 3, 512, 64), dtype=np.float32) for _ in range(2))
    return {
        "causal forward, N = 4096, H = 8": (1, lambda th: tiled.forward(q, k, v, scale=0.125, is_causal=True,
                                                                        threads=th)),
        "SmolLM2 prefill attention (9 on 3 heads, 512)": (20, lambda th: tiled.forward(
            sq, sk, sv, scale=0.125, is_causal=True, enable_gqa=True, threads=th)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    if not 1 <= args.repeats <= 1000 or not 2 <= args.workers <= 1024:
        ap.error(f"expected 1 <= --repeats <= 1000 and 2 <= --workers <= 1024, got {args.repeats} and {args.workers}")
    from qkv.bench import environment_line
    print(f"{environment_line()}; load average {os.getloadavg()[0]:.2f} at start")
    qkv.set_num_threads(args.workers)
    for name, (calls, fn) in _cases().items():
        sides = (1, args.workers)
        runs = {th: (lambda th=th: [fn(th) for _ in range(calls)]) for th in sides}
        times = _variant_times(runs, args.repeats)
        one, many = (statistics.median(times[th]) / calls for th in sides)
        print(f"{name}: 1 worker {one * 1e3:.2f} ms, {args.workers} workers {many * 1e3:.2f} ms, "
              f"{one / many:.2f}x (target >= 1.8x at 2)")


if __name__ == "__main__":
    main()
