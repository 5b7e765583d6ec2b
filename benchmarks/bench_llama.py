"""qkv's SmolLM2 decoder vs transformers on the same GGUF file, side by side in one run (CPU, float32).

    .venv/bin/python benchmarks/bench_llama.py [--repeats 5] [--threads N] [--new-tokens 64] [--prefill 512]
                                               [--skip-load] [--only generate,prefill,forward,scaling]
    .venv/bin/python benchmarks/bench_llama.py --only llamacpp [--weights auto|float32] [--kv-dtype float16]
                                               [--activations int8]

``--only llamacpp`` is qkv against llama.cpp (llama-cpp-python: the ``bench`` extra) on the same file and
threads, described in ``benchmarks/_llamacpp.py``; the rest is qkv against transformers:

What is timed (each side once to warm up, then ``--repeats`` times alternately, each call after a ``--settle``
pause so the other side's idle threads stop spinning; the medians and their ratio qkv / transformers):

* generation: greedy, ``--new-tokens`` (64) new tokens after a 30-token prompt — ``model.generate`` against
  transformers' ``generate(do_sample=False, min_new_tokens=64)`` (its KV cache, its default SDPA attention);
  both sides must produce the same tokens;
* prefill: ``--prefill`` (512) tokens through the model once, filling the KV cache, logits of the last token
  (``model.step(ids, caches)`` against ``model(ids, use_cache=True, logits_to_keep=1)``), and the same forward
  with the logits of every position (``model.forward(ids)`` against ``model(ids)``);
* load (GGUF file → ready to run) and resident memory after it, each side in a fresh Python process
  (``--skip-load`` skips these);
* scaling (``--only scaling``, qkv alone, not part of the default): the same prefill on one worker against
  ``--threads`` workers (issue 29's target: two workers ≥ 1.8× one), each side as ``benchmarks/_threads.py``
  sets n threads — ``qkv.set_num_threads(n)`` and BLAS limited to n threads (so one worker is one core) —
  ``--repeats`` times alternately, each call once the CPUs are idle (other processes' work on the same cores
  skews one side) and after a ``--settle`` pause; the medians, their ratio and the voluntary context switches of
  one prefill (the GIL handed between threads).

Both sides get the same number of threads (``--threads``, default: the CPUs this process may use):
torch.set_num_threads, BLAS via threadpoolctl, and qkv's runtime. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. One night, a terrible "
          "storm rolled in from the dark sea, and the old")         # 30 tokens with SmolLM2's tokenizer

_LOAD_QKV = """
import json, time, os
t = time.perf_counter()
from qkv.models import load_llama
m = load_llama()
dt = time.perf_counter() - t
rss = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
print(json.dumps({"seconds": dt, "rss": rss}))
"""

_LOAD_HF = """
import json, time, os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
t = time.perf_counter()
import torch, transformers
from qkv.models.llama import default_model_path
p = default_model_path()
tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
m = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
dt = time.perf_counter() - t
rss = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
print(json.dumps({"seconds": dt, "rss": rss}))
"""


def _fresh(code: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _timed(fn, settle: float) -> float:
    time.sleep(settle)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_busy() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs so far (Linux's /proc/stat), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:                                                        # pragma: no cover - not Linux
        return None
    return sum(v) - v[3] - v[4], sum(v)


def _wait_idle(busy_below: float = 0.1, window: float = 0.3, at_most: float = 120.0) -> float:
    """Wait until the CPUs were idle (under ``busy_below`` busy over ``window`` seconds: another process's
    benchmark on the same cores doubles a one-worker time), at most ``at_most`` seconds; returns the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < at_most:
        a = _cpu_busy()
        time.sleep(window)
        b = _cpu_busy()
        if a is None or b is None or (b[0] - a[0]) < busy_below * max(1, b[1] - a[1]):
            break
    return time.perf_counter() - t0


def _scaling(model, ids, threads: int, repeats: int, settle: float) -> None:
    """``--only scaling``: the prefill on 1 worker against ``threads`` (see the module doc)."""
    import resource

    from _threads import set_threads                         # benchmarks/_threads.py, beside this script

    import qkv

    def prefill(n: int) -> tuple[float, int]:
        with set_threads(n):                                 # qkv, BLAS (and torch) on n threads
            waited.append(_wait_idle())
            before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            t = _timed(lambda: model.step(ids, model.new_caches()), settle)
            return t, resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before

    sides, waited = (1, threads), []
    for n in sides:                                                        # warm-up
        prefill(n)
    got = {n: [] for n in sides}
    for _ in range(repeats):
        for n in sides:
            got[n].append(prefill(n))
    one, many = (statistics.median(t for t, _ in got[n]) for n in sides)
    switches = [statistics.median(c for _, c in got[n]) for n in sides]
    print(f"prefill of {ids.shape[1]} tokens (last logits), 1 worker median {one * 1e3:.0f} ms (best "
          f"{min(t for t, _ in got[1]) * 1e3:.0f}), {threads} workers median {many * 1e3:.0f} ms (best "
          f"{min(t for t, _ in got[threads]) * 1e3:.0f}); {threads} workers {one / many:.2f}x faster than one "
          f"(target >= 1.8x at 2); voluntary context switches per prefill {switches[0]:.0f} / {switches[1]:.0f}; "
          f"waited {sum(waited):.0f} s in all for idle CPUs")
    qkv.set_num_threads(threads)


def _arguments():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds of pause before each timed call")
    ap.add_argument("--skip-load", action="store_true", help="skip the load-time and memory measurements")
    ap.add_argument("--weights", default="auto", help="qkv's weights: auto (as the file stores them) or float32")
    ap.add_argument("--kv-dtype", default="float32", help="qkv's KV cache: float32, float16 or int8")
    ap.add_argument("--activations", default="float32", help="qkv's decoding products: float32 or int8 (as llama.cpp)")
    ap.add_argument("--only", default="generate,prefill,forward",
                    help="which of generate, prefill, forward, scaling to time (comma-separated)")
    args = ap.parse_args()
    only = {w.strip() for w in args.only.split(",")}
    unknown = only - {"generate", "prefill", "forward", "scaling", "llamacpp"}
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}; expected some of generate, prefill, forward, scaling, llamacpp")
    return args, only


def main() -> None:
    args, only = _arguments()
    if only == {"llamacpp"}:                                               # qkv and llama.cpp: no torch
        _against_llamacpp(args)
        return
    import numpy as np
    import torch
    import transformers

    import qkv
    from qkv.models.llama import load_llama

    from qkv.bench import environment_line
    print(f"{environment_line()}; threads {args.threads} (torch, BLAS, qkv runtime); "
          f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    if only == {"scaling"}:                                                # qkv alone: no transformers model
        model = load_llama()
        ids = np.random.default_rng(0).integers(100, model.config.vocab_size, (1, args.prefill))
        _scaling(model, ids, args.threads, args.repeats, args.settle)
        return
    if not args.skip_load:
        q = _fresh(_LOAD_QKV, args.threads)
        h = _fresh(_LOAD_HF, args.threads)
        print(f"load (fresh process, GGUF → ready): qkv {q['seconds']:.1f} s, RSS {q['rss'] / 2**20:.0f} MiB; "
              f"transformers {h['seconds']:.1f} s, RSS {h['rss'] / 2**20:.0f} MiB  "
              f"(ratio {q['seconds'] / h['seconds']:.2f}x time, {q['rss'] / h['rss']:.2f}x memory)")

    torch.set_num_threads(args.threads)
    qkv.set_num_threads(args.threads)
    _side_by_side(args, only)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def _side_by_side(args, only) -> None:
    """qkv and transformers on the same GGUF file: generation, prefill, forward, alternately timed."""
    import numpy as np
    import torch
    import transformers
    from threadpoolctl import threadpool_limits

    from qkv.models.llama import default_model_path, load_llama
    path = default_model_path()
    model = load_llama()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    prompt_ids = model.encode(PROMPT)
    assert prompt_ids == tok(PROMPT)["input_ids"]
    ids_t = torch.tensor([prompt_ids])
    rng = np.random.default_rng(0)
    long_ids = rng.integers(100, model.config.vocab_size, (1, args.prefill))
    long_t = torch.from_numpy(long_ids)
    results = {}

    def q_gen():
        results["q_gen"] = model.generate(PROMPT, max_new_tokens=args.new_tokens).ids

    def h_gen():
        with torch.inference_mode():
            out = hf.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False)
        results["h_gen"] = out[0, len(prompt_ids):].tolist()

    def q_prefill():
        results["q_pre"] = model.step(long_ids, model.new_caches())

    def h_prefill():
        with torch.inference_mode():
            results["h_pre"] = hf(long_t, use_cache=True, logits_to_keep=1).logits[:, -1].numpy()

    def q_forward():
        results["q_fwd"] = model.forward(long_ids)

    def h_forward():
        with torch.inference_mode():
            results["h_fwd"] = hf(long_t, use_cache=False).logits.numpy()

    pairs = {"generate": (q_gen, h_gen), "prefill (last logits)": (q_prefill, h_prefill),
             "forward (all logits)": (q_forward, h_forward)}
    pairs = {name: fns for name, fns in pairs.items() if name.split()[0] in only}
    times = {k: ([], []) for k in pairs}
    with threadpool_limits(limits=args.threads, user_api="blas"):
        for name, (fq, fh) in pairs.items():
            fq(), fh()                                                     # warm-up
            for _ in range(args.repeats):
                times[name][0].append(_timed(fq, args.settle))
                times[name][1].append(_timed(fh, args.settle))
    if "q_gen" in results:
        print(f"prompt {len(prompt_ids)} tokens; generated {len(results['q_gen'])} tokens, identical to "
              f"transformers': {results['q_gen'] == results['h_gen']}")
    for key, what in (("pre", "last"), ("fwd", "all")):
        if f"q_{key}" in results:
            print(f"{args.prefill} tokens, max |Δ logits| {np.abs(results[f'q_{key}'] - results[f'h_{key}']).max():.1e} "
                  f"({what})")
    for name, (tq, th) in times.items():
        mq, mh = statistics.median(tq), statistics.median(th)
        extra = f", {args.new_tokens / mq:.1f} vs {args.new_tokens / mh:.1f} tokens/s" if name == "generate" else ""
        print(f"{name:>22}: qkv median {mq:.3f} s (best {min(tq):.3f}), transformers median {mh:.3f} s "
              f"(best {min(th):.3f}); ratio of medians {mq / mh:.2f}x (target <= 1.0){extra}")
    if "scaling" in only:
        _scaling(model, long_ids, args.threads, args.repeats, args.settle)


def _against_llamacpp(args) -> None:
    """``--only llamacpp``: decode at 30 and 4,096 tokens of context, prefill 512 and 4,096, against llama.cpp."""
    import llama_cpp
    import numpy as np

    import qkv
    from qkv.bench import environment_line
    from qkv.models.llama import default_model_path, load_llama

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _llamacpp
    qkv.set_num_threads(args.threads)
    print(f"{environment_line()}; threads {args.threads}; llama-cpp-python {llama_cpp.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    model = load_llama(weights=args.weights, activations=args.activations)
    kv = None if args.kv_dtype == "float32" else np.dtype(args.kv_dtype)
    _llamacpp.agreement(default_model_path(), model, args.threads, kv_dtype=kv)
    _llamacpp.run(default_model_path(), model, args.threads, args.repeats, args.settle, args.new_tokens, kv)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
