"""qkv.torch against torch's SDPA, forward + backward, side by side in one run (CPU, float32).

    .venv/bin/python benchmarks/bench_torch.py [--length 4096] [--repeats 5] [--threads N] [--only window,causal]
                                               [--json FILE]

B = 1, H = 8, E = 64, float32 tensors with ``requires_grad``; what is timed is one training step of the
attention alone: ``out = attention(q, k, v); out.backward(grad)`` (the gradients set to None before each).

* **window**: a causal sliding window of 256 keys. qkv: ``qkv.torch.flex_attention`` with torch's own
  ``BlockMask`` (``create_block_mask(..., device="cpu")``, built once, outside the timing: its mask mod is
  called with torch tensors on the partial blocks) — and with qkv's ``create_block_mask(mods.sliding_window(256))``
  (a mod with traits: its partial blocks are cached patterns). torch: SDPA with the dense (L, L) bool mask (what
  torch offers on CPU: its flex_attention has no backward there). Target: ≤ 0.3× torch.
* **causal**: ``qkv.torch.scaled_dot_product_attention(is_causal=True)`` and ``qkv.torch.flex_attention`` with
  torch's causal BlockMask, against torch's SDPA ``is_causal=True``. Target: ≤ 1.1×.

Each variant once to warm up, then ``--repeats`` rounds, every variant once per round in turn (alternating, so
that a change in the machine's load falls on all of them); the medians and their ratio to torch's (below 1: qkv
is faster). Both sides get the same threads (``--threads``, default the CPUs this process may use):
torch.set_num_threads, BLAS via threadpoolctl, and qkv's runtime. Outputs and gradients are compared once
(max |Δ|) so the figures are of the same computation. On a machine shared with other work the medians move: the
load average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

WINDOW = 256
B, H, E = 1, 8, 64


def _threads(n: int):
    from _threads import set_threads                         # benchmarks/_threads.py, beside this script
    return set_threads(n)


def _inputs(N: int):
    import torch
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, N, E, generator=g) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], grad


def _variants(case: str, N: int) -> dict:
    """name → attention(q, k, v); the torch baseline is named "torch"."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import qkv
    import qkv.torch as qt
    from qkv import mods

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if case == "window":
        def window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)
        i = torch.arange(N)
        dense = window(None, None, i[:, None], i[None, :])                    # (L, L) bool, True = may attend
        t_bm = create_block_mask(window, None, None, N, N, device="cpu")
        q_bm = qkv.create_block_mask(mods.sliding_window(WINDOW), None, None, N, N)
        return {"torch": lambda q, k, v: sdpa(q, k, v, attn_mask=dense),
                "qkv flex, torch BlockMask": lambda q, k, v: qt.flex_attention(q, k, v, block_mask=t_bm),
                "qkv flex, qkv BlockMask": lambda q, k, v: qt.flex_attention(q, k, v, block_mask=q_bm)}

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    t_bm = create_block_mask(causal, None, None, N, N, device="cpu")
    return {"torch": lambda q, k, v: sdpa(q, k, v, is_causal=True),
            "qkv sdpa is_causal": lambda q, k, v: qt.scaled_dot_product_attention(q, k, v, is_causal=True),
            "qkv flex, torch BlockMask": lambda q, k, v: qt.flex_attention(q, k, v, block_mask=t_bm)}


def _step(fn, qkv_in, grad) -> float:
    for t in qkv_in:
        t.grad = None
    t0 = time.perf_counter()
    fn(*qkv_in).backward(grad)
    return time.perf_counter() - t0


def _agreement(variants: dict, qkv_in, grad) -> dict:
    """max |Δ| of each variant's output and gradients from torch's."""
    want = None
    out = {}
    for name, fn in variants.items():
        for t in qkv_in:
            t.grad = None
        o = fn(*qkv_in)
        o.backward(grad)
        got = [o.detach()] + [t.grad.clone() for t in qkv_in]
        if want is None:
            want = got
        else:
            out[name] = max(float((a - b).abs().max()) for a, b in zip(got, want))
    return out


def run(case: str, N: int, repeats: int) -> dict:
    qkv_in, grad = _inputs(N)
    variants = _variants(case, N)
    agree = _agreement(variants, qkv_in, grad)                            # also the warm-up
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():                                 # alternating
            times[name].append(_step(fn, qkv_in, grad))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"case": case, "N": N, "median_s": med, "ratio": {n: med[n] / med["torch"] for n in med if n != "torch"},
            "max_abs_diff": agree, "runs": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--only", default="window,causal")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch
    limits = _threads(a.threads)
    print(f"{platform.processor() or platform.machine()}, {a.threads} threads, torch {torch.__version__}; "
          f"B={B}, H={H}, E={E}, N={a.length}, float32, forward + backward; load average {os.getloadavg()}")
    results = []
    for case in a.only.split(","):
        r = run(case, a.length, a.repeats)
        results.append(r)
        print(f"\n{case} (torch: {r['median_s']['torch'] * 1e3:.0f} ms)")
        for name, ratio in r["ratio"].items():
            print(f"  {name:28s} {r['median_s'][name] * 1e3:8.0f} ms  {ratio:5.2f}× torch   "
                  f"max |Δ| {r['max_abs_diff'][name]:.2g}")
    print(f"\nload average after: {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    del limits
    return 0


if __name__ == "__main__":
    sys.exit(main())
