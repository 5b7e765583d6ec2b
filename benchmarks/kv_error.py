"""SmolLM2-135M's KV cache in float16 and int8 against float32: what it changes in the logits, and decode speed.

    PYTHONPATH=src .venv/bin/python benchmarks/kv_error.py [--tokens 2048] [--context 4096] [--steps 64]
                                                           [--repeats 3] [--skip-error] [--skip-speed]
                                                           [--dtypes float16,int8] [--int8-block 32]

The text: the repository's own docs, ``docs/*.md`` without the symbolic links (the benchmark tables, which
this script's output lands in), sorted by name and joined by blank lines, tokenized by the model's tokenizer.
Nothing is downloaded.

Error (``--tokens``, 2,048): teacher forcing — every true token stepped through the model one at a time
(``model.step([[token]], caches)``, L = 1) with a float32, a float16 and an int8 cache side by side; at every
position after the first (the first reads no cache) the quantized caches' logits against the float32 cache's:
max and mean |Δ logit| (over positions and the vocabulary), the mean KL divergence KL(p_float32 ‖ p_quantized)
in nats (float64 softmax), the greedy agreement (argmax equal) and the bytes per token of context (every
layer's keys, values and scales). The float32 row compares the float32 cache with ``model.forward`` of the
whole text (the full causal forward): the noise the cache path has without any quantization. Then the
round-trip error of the model's own keys and values (every layer, the float32 cache's) stored as int8 with one
float32 scale per row of 64 (qkv's choice) and as llama.cpp's q8_0 (blocks of 32, float16 scale).

Speed (``--context`` 4,096 tokens, ``--steps`` 64): one float32 prefill of the text's first ``--context``
tokens, its caches copied into each storage (what a float16/int8 prefill stores), then ``--steps`` decoding
steps of the next true tokens (``model.step``, float32 weights, BLAS on one thread as ``model.generate``
runs it), ``--repeats`` times per dtype in turn; the median tokens/s. Then one layer's attention alone over
that context (layer 15's cache, one query of 9 heads, one thread, the median of 50 calls per path in turn):
the float32 cache through the engine (as the model runs it) and each storage through the compiled kernel
(float32 too: the same loop, four bytes a number).

``--int8-block`` (an experiment): the int8 format's block (32, q8_0's; 64 = one scale per row of SmolLM2's
64) — the kernel reads any.
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import subprocess
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = (("float32", None), ("float16", np.float16), ("int8", np.int8))


def docs_text() -> str:
    files = sorted(p for p in (ROOT / "docs").glob("*.md") if not p.is_symlink())
    return "\n\n".join(p.read_text(encoding="utf-8") for p in files)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class Stats:
    """Running max/mean |Δ logit|, mean KL and argmax agreement of one side against a reference."""

    def __init__(self):
        self.max = 0.0
        self.abs_sum = 0.0
        self.count = 0
        self.kl = []
        self.agree = 0
        self.positions = 0

    def add(self, ref: np.ndarray, got: np.ndarray) -> None:
        d = np.abs(got.astype(np.float64) - ref)
        self.max = max(self.max, float(d.max()))
        self.abs_sum += float(d.sum())
        self.count += d.size
        lp, lq = log_softmax(ref), log_softmax(got)
        self.kl.append(float((np.exp(lp) * (lp - lq)).sum()))
        self.agree += int(np.argmax(ref) == np.argmax(got))
        self.positions += 1

    def row(self, name: str, nbytes: int) -> str:
        return (f"| {name} | {self.max:.3g} | {self.abs_sum / self.count:.3g} | {np.mean(self.kl):.3g} | "
                f"{100.0 * self.agree / self.positions:.2f} % | {nbytes:,} |")


def error_table(model, ids: list[int]) -> tuple[str, list]:
    """The Markdown table of the error run, and the float32 caches (for the round-trip table)."""
    full = model.forward(ids)[0]                                           # (T, V) the full causal forward
    caches = {name: model.new_caches(dt) for name, dt in DTYPES}
    stats = {name: Stats() for name, _ in DTYPES}
    t0 = time.perf_counter()
    from qkv.engine.backends.runtime import RUNTIME
    with RUNTIME.blas_single_threaded():
        for t, tok in enumerate(ids):
            logits = {name: model.step([[tok]], caches[name])[0] for name, _ in DTYPES}
            if t == 0:
                continue                                                   # no cache read yet: all equal
            ref = logits["float32"].astype(np.float64)
            stats["float32"].add(full[t].astype(np.float64), logits["float32"])
            for name, _ in DTYPES[1:]:
                stats[name].add(ref, logits[name])
            if t % 256 == 0:
                print(f"  position {t}/{len(ids)}, {time.perf_counter() - t0:.0f} s", flush=True)
    lines = [f"{len(ids):,} tokens of docs/*.md, teacher forcing, one token a step; {len(ids) - 1:,} positions "
             f"compared (the first reads no cache)", "",
             "| cache | max \\|Δ logit\\| | mean \\|Δ logit\\| | mean KL (nats) | greedy agreement | bytes / token |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, _ in DTYPES:
        nbytes = sum(c.nbytes_per_token() for c in caches[name])
        label = "float32 (vs the full forward)" if name == "float32" else f"{name} (vs the float32 cache)"
        lines.append(stats[name].row(label, nbytes))
    return "\n".join(lines), caches["float32"]


def q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0 and back: blocks of 32, d = max|x| / 127, q = round(x · (1/d)), d stored as
    float16 (rounded to nearest)."""
    b = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(b).max(axis=1) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(b * inv[:, None])
    return (q * d.astype(np.float16).astype(np.float32)[:, None]).reshape(x.shape)


def per_row(x: np.ndarray) -> np.ndarray:
    """One float32 scale per row: d = max|x| / 127, q = round(x / d), and back."""
    d = np.abs(x).max(axis=-1, keepdims=True) / 127
    return np.rint(np.divide(x, d, out=np.zeros_like(x), where=d > 0)) * d


def roundtrip_table(caches) -> str:
    """The round-trip error of the model's keys and values (every layer) in three int8 formats."""
    from qkv.core import kv_quant as _kv_quant
    E = caches[0].keys.shape[-1]
    lines = [f"| | RMS of the numbers | qkv's int8 (blocks of {_kv_quant.BLOCK}, float16 scale rounded up): max "
             "\\|err\\| / RMS err | llama.cpp's q8_0: max / RMS | one float32 scale per row of "
             f"{E}: max / RMS |", "|---|---:|---:|---:|---:|"]
    for what in ("keys", "values"):
        x = np.concatenate([getattr(c, what).reshape(-1, E) for c in caches]).astype(np.float32)
        q = np.empty(x.shape, np.int8)
        d = np.empty((x.shape[0], _kv_quant.blocks(E)), np.float16)
        _kv_quant.store(x, q, d, what)
        cells = []
        for got in (_kv_quant.load(q, d, np.float32), q8_0(x), per_row(x)):
            err = (got - x).astype(np.float64)
            cells.append(f"{np.abs(err).max():.3g} / {np.sqrt(np.mean(err ** 2)):.3g}")
        rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
        lines.append(f"| {what} | {rms:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_table(model, ids: list[int], context: int, steps: int, repeats: int) -> tuple[str, list]:
    from qkv import KVCache
    from qkv.engine.backends.runtime import RUNTIME
    if len(ids) < context + steps:
        raise SystemExit(f"--context {context} + --steps {steps}: the text has {len(ids)} tokens")
    base = model.new_caches()
    model.step([ids[:context]], base)                                      # float32 prefill
    times = {name: [] for name, _ in DTYPES}
    for _ in range(repeats):
        for name, dt in DTYPES:
            caches = []
            for c in base:
                caches.append(KVCache(dt))
                caches[-1].append(c.keys, c.values)
            with RUNTIME.blas_single_threaded():
                model.step([[ids[context]]], caches)                      # warm-up (compiles the kernel once)
                t = time.perf_counter()
                for tok in ids[context + 1:context + 1 + steps]:
                    model.step([[tok]], caches)
                times[name].append(time.perf_counter() - t)
    lines = [f"decoding {steps} tokens after {context:,} tokens of context, median of {repeats}", "",
             "| cache | tokens/s | ms/token | cache bytes read per token |", "|---|---:|---:|---:|"]
    for name, dt in DTYPES:
        sec = statistics.median(times[name])
        per = KVCache(dt)
        per.append(base[0].keys[:, :, :1], base[0].values[:, :, :1])
        nbytes = per.nbytes_per_token() * len(base) * (context + steps // 2)
        lines.append(f"| {name} | {steps / sec:.1f} | {1000 * sec / steps:.1f} | {nbytes / 2**20:.0f} MiB |")
    return "\n".join(lines), base


def kernel_table(base: list, context: int, repeats: int = 50) -> str:
    """One layer's attention over ``context`` tokens per path, µs a call (median), one thread."""
    from qkv import KVCache, scaled_dot_product_attention
    from qkv.compute import kv_decode
    from qkv.core import kv_quant as _kv_quant
    layer = base[len(base) // 2]
    k, v = layer.keys[:, :, :context], layer.values[:, :, :context]
    q = np.random.default_rng(0).standard_normal((1, 9, 1, k.shape[3])).astype(np.float32)
    caches = {}
    for name, dt in DTYPES:
        caches[name] = KVCache(dt)
        caches[name].append(k, v)
    calls = {"float32, the engine (the model's path)":
             lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    for name, _ in DTYPES:
        st = caches[name].storage()
        calls[f"{name}, the kernel"] = lambda st=st: kv_decode.decode(q, *st, context, 0.125, 1, _kv_quant.BLOCK)
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, f in calls.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    lines = [f"one layer's attention (9 query heads on 3 key/value heads, 1 query) over {context:,} tokens, "
             f"one thread, median of {repeats}", "", "| cache, path | µs a call |", "|---|---:|"]
    lines += [f"| {name} | {1e6 * statistics.median(t):.0f} |" for name, t in times.items()]
    return "\n".join(lines)


def header() -> str:
    import numpy

    import qkv
    from qkv.compute.kernels import KERNELS
    from qkv.engine.backends.runtime import RUNTIME
    cpu = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "?"
    return (f"CPU {cpu} ({platform.machine()}), {RUNTIME.get_num_threads()} threads; numpy {numpy.__version__}; "
            f"kernels {KERNELS.describe()}; qkv {getattr(qkv, '__version__', '?')} at {rev}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-error", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--dtypes", default="float16,int8", help="the storages compared with float32")
    ap.add_argument("--int8-block", type=int, default=32)
    args = ap.parse_args(argv)
    from qkv.core import kv_quant as _kv_quant
    _kv_quant.BLOCK = args.int8_block
    global DTYPES
    DTYPES = tuple(d for d in DTYPES if d[0] == "float32" or d[0] in args.dtypes.split(","))
    from qkv.models import load_llama
    model = load_llama()
    ids = model.encode(docs_text())
    print(header() + (f"; int8 blocks of {args.int8_block}" if args.int8_block != 32 else ""))
    print(f"text: docs/*.md, {len(ids):,} tokens\n")
    if not args.skip_error:
        table, caches = error_table(model, ids[:args.tokens])
        print(table + "\n")
        print(roundtrip_table(caches) + "\n")
    if not args.skip_speed:
        table, base = speed_table(model, ids, args.context, args.steps, args.repeats)
        print(table + "\n")
        print(kernel_table(base, args.context))


if __name__ == "__main__":
    main()
