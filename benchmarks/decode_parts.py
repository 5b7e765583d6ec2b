"""Where a compiled decoding step's time goes: the step of :mod:`qkv.models._decode_jit` assembled with some of
its parts replaced by stand-ins that do nothing, each variant timed in turn on the same caches (the new token's
row written, then taken back), medians. The parts: the matrix–vector products, the attention over the cache,
and the rest (RMSNorm, RoPE, SwiGLU); the cache's stores always run.

    .venv/bin/python benchmarks/decode_parts.py --context 30 --activations int8 --kv-dtype float16
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import njit


@njit
def _no_matvec(kind, bs, w, x, out, chunks):
    out[...] = 0.0                      # a stand-in's output is read on: zeros, which every cache can store


@njit
def _no_decode(q, k, v, ks, vs, S, out, bw, parts):
    out[...] = 0.0


@njit
def _no_rows(*args):
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=30)
    ap.add_argument("--activations", default="int8")
    ap.add_argument("--kv-dtype", default="float16", help="float32, float16 or int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    import qkv
    from qkv.compute import kv_decode
    from qkv.compute.kernels import KERNELS
    from qkv.models import _decode, _decode_jit
    from qkv.models.llama import load_llama

    qkv.set_num_threads(args.threads)
    model = load_llama(activations=args.activations)
    kv = None if args.kv_dtype == "float32" else np.dtype(args.kv_dtype)
    caches = model.new_caches(dtype=kv)
    model.step(np.random.default_rng(0).integers(100, model.config.vocab_size, args.context)[None], caches)
    step = _decode.compiled_step(model, np.array([[1]]), caches)
    real = step.step
    jit, fmt = KERNELS.jit(), kv_decode.STORAGES[np.dtype(np.float32) if kv is None else kv]
    decode, store = kv_decode.step_kernels(fmt)
    variants = {"whole step": real}
    parts = {"products": (_no_matvec, None), "attention": (None, _no_decode)}
    for name, (mv, dec) in parts.items():
        variants[f"without the {name}"] = _decode_jit.assemble(
            mv or _decode_jit.products(args.activations == "int8"), dec or decode, store, jit.rms_norm_rows,
            jit.rope_rows, jit.swiglu_rows)
    variants["without products, attention, norms, RoPE, SwiGLU"] = _decode_jit.assemble(
        _no_matvec, _no_decode, store, _no_rows, _no_rows, _no_rows)
    times = {name: [] for name in variants}
    for _ in range(3):
        for name, fn in variants.items():
            step.step = fn
            for i in range(args.steps // 3 + 1):
                t = time.perf_counter()
                step(np.array([[1]]), caches)
                if i:
                    times[name].append(time.perf_counter() - t)
                for cache in caches:
                    cache.truncate(cache.offset - 1)
    step.step = real
    print(f"context {args.context}, activations {args.activations}, KV cache {args.kv_dtype}, threads {args.threads}:")
    for name, ts in times.items():
        print(f"  {name:>48}: {statistics.median(ts) * 1e3:6.2f} ms (min {min(ts) * 1e3:.2f})")


if __name__ == "__main__":
    main()
