"""SmolLM2-135M's weights kept as the GGUF file stores them (``load_llama(weights="auto")``, QuantMatrix) against
every tensor dequantized to float32 (``weights="float32"``), in one run.

    .venv/bin/python benchmarks/bench_quant.py [--threads 2] [--new-tokens 64] [--repeats 3]

Printed:

* decoding: the model's own ``generate`` (greedy, ``--new-tokens`` new tokens after a 30-token prompt), each
  side ``--repeats`` times alternately after a warm-up; the medians of the time per new token (the whole call
  over the tokens) and per decoding step (the call less one prefill of the prompt, over the tokens after the
  first); both sides must produce the same tokens;
* the bytes of weights a decoding step reads: every layer's projections and the LM head, as held;
* the one-row product (a decoding step's GEMV) on the largest matrices: a layer's fused gate|up (3072 × 576,
  Q4_1: 1.1 MB as stored, 7.1 MB as float32) and the LM head (49152 × 576, Q8_0: 30 MB, 113 MB), once the same
  matrix over and over (it stays in the caches: the kernel's speed) and once each of the 30 layers' gate|up in
  turn (33 MB or 212 MB: read from memory), QuantMatrix.matmul against NumPy's ``x @ W`` on the float32
  (in, out) array the float32 model holds — in GB/s of the bytes each reads, and in weights per ns.

Threads: ``--threads`` (default 2) for qkv's runtime (the QuantMatrix kernels' threads) and BLAS. Timings go
in no test; the machine's other work moves them (the best of the repeats is printed for the GEMVs).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

PROMPT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. One night, a terrible "
          "storm rolled in from the dark sea, and the old")         # 30 tokens with SmolLM2's tokenizer


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weight_bytes(model) -> int:
    """The bytes of the projections and the LM head (what one decoding step reads)."""
    mats = [w for lyr in model._layers for w in (lyr.w_qkv, lyr.w_o, lyr.w_gate_up, lyr.w_down)]
    return sum(int(w.nbytes) for w in mats + [model._lm_head_t])


def decode(models: dict, new_tokens: int, repeats: int) -> None:
    prompt_ids = models["auto"].encode(PROMPT)
    times = {k: [] for k in models}
    prefill = {k: [] for k in models}
    texts = {}
    for k, m in models.items():                                    # warm-up (compiles or loads the kernels)
        m.generate(PROMPT, max_new_tokens=4)
    for _ in range(repeats):
        for k, m in models.items():
            t = time.perf_counter()
            m.step([prompt_ids], m.new_caches())
            prefill[k].append(time.perf_counter() - t)
            t = time.perf_counter()
            g = m.generate(PROMPT, max_new_tokens=new_tokens)
            times[k].append(time.perf_counter() - t)
            texts[k] = g.ids
    n = len(texts["auto"])
    print(f"decoding: {len(prompt_ids)}-token prompt, {n} new tokens (greedy), medians of {repeats}; "
          f"same tokens: {texts['auto'] == texts['float32']}")
    for k in models:
        total, pre = statistics.median(times[k]), statistics.median(prefill[k])
        print(f"  weights={k:8s} {total / n * 1e3:7.1f} ms/token   {(total - pre) / (n - 1) * 1e3:7.1f} ms/step "
              f"(prefill {pre * 1e3:.0f} ms)   weights read per step {weight_bytes(models[k]) / 1e6:6.1f} MB")


def _best(fn, calls: int, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def gemv(models: dict) -> None:
    a, f = models["auto"], models["float32"]
    cases = [("gate|up of layer 0, again and again", [a._layers[0].w_gate_up], [f._layers[0].w_gate_up], 200),
             ("gate|up of each of the 30 layers", [lyr.w_gate_up for lyr in a._layers],
              [lyr.w_gate_up for lyr in f._layers], 5),
             ("LM head", [a._lm_head_t], [f._lm_head_t], 10)]
    print("one-row products (x (1, in) float32; the best of 7; float32: NumPy's BLAS on --threads threads):")
    for name, qs, fs, calls in cases:
        x = np.random.default_rng(0).normal(size=(1, qs[0].shape[1])).astype(np.float32)
        tq = _best(lambda: [q.matmul(x) for q in qs], calls)
        tf = _best(lambda: [x @ w for w in fs], calls)
        nq, nf = sum(q.nbytes for q in qs), sum(w.nbytes for w in fs)
        weights = sum(q.shape[0] * q.shape[1] for q in qs)
        print(f"  {name} ({qs[0].qtype} {qs[0].shape[0]}×{qs[0].shape[1]}{' ×30' if len(qs) > 1 else ''}):\n"
              f"      QuantMatrix {tq * 1e6:7.0f} µs {nq / tq / 1e9:5.1f} GB/s {weights / tq / 1e9:5.2f} weights/ns | "
              f"float32 {tf * 1e6:7.0f} µs {nf / tf / 1e9:5.1f} GB/s {weights / tf / 1e9:5.2f} weights/ns | "
              f"{tf / tq:4.2f}× the speed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import numba
    import qkv
    from qkv.models import load_llama
    from threadpoolctl import threadpool_limits

    qkv.set_num_threads(args.threads)
    limiter = threadpool_limits(args.threads)                      # noqa: F841 (kept alive)
    t = time.perf_counter()
    models = {"auto": load_llama(weights="auto")}
    load_auto = time.perf_counter() - t
    t = time.perf_counter()
    models["float32"] = load_llama(weights="float32")
    load_f32 = time.perf_counter() - t
    print(f"CPU: {cpu_name()} ({len(os.sched_getaffinity(0))} CPUs usable); threads {args.threads}; "
          f"numba {numba.__version__}; NumPy {np.__version__}")
    print(f"load: auto {load_auto:.1f} s, float32 {load_f32:.1f} s")
    decode(models, args.new_tokens, args.repeats)
    try:
        print(f"numba threading layer: {numba.threading_layer()}")
    except ValueError:                                             # one thread: no parallel call was made
        print("numba threading layer: none (one thread)")
    gemv(models)


if __name__ == "__main__":
    main()
