"""transformers models with attn_implementation="qkv" against "sdpa", side by side in one run (CPU, float32).

    .venv/bin/python benchmarks/bench_hf.py [--repeats 5] [--threads N] [--only llama,mistral] [--json FILE]

Two models with random weights, built from their configs (nothing is downloaded), each run on both sides:

* **llama**: Llama-shaped, 2 layers, width 512, 8 heads of 64, 2,048 tokens, causal;
* **mistral**: Mistral-shaped, the same widths, a 256-token sliding window, 4,096 tokens.

What is timed, per model: the forward (``model(ids)`` under ``torch.no_grad()``, logits of every position) and a
training step (``model(ids, labels=ids).loss.backward()``, train mode, the gradients zeroed before each). Each
side once to warm up, then ``--repeats`` times alternately; the medians and their ratio qkv / sdpa (below 1:
qkv is faster). Both sides get the same threads (``--threads``, default the CPUs this process may use):
torch.set_num_threads, BLAS via threadpoolctl, and qkv's runtime. The two sides' logits are compared once
(max |Δ|) so the figures are of the same computation. Beside each median, the time the attention layers' forward
calls took within it (the registered functions timed inside the model), which the shared rest of the model does
not blur. On a machine shared with other work the medians move: the script prints the load average before and
after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: The two models: (name, config class, tokens, extra config).
MODELS = {
    "llama": ("LlamaConfig", 2048, {}),
    "mistral": ("MistralConfig", 4096, {"sliding_window": 256}),
}
WIDTHS = dict(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=8192)


def _threads(n: int):
    from _threads import set_threads                         # benchmarks/_threads.py, beside this script
    return set_threads(n)


def _model(name: str):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, T, extra = MODELS[name]
    config = getattr(transformers, cls)(**WIDTHS, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    ids = torch.randint(0, WIDTHS["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    return model, ids


def _forward(model, ids):
    import torch
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train_step(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class _AttentionClock:
    """Times the attention functions themselves inside the model (their forward calls): the registered "sdpa" and
    "qkv" functions wrapped while the clock is on, restored after."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        from transformers import AttentionInterface
        self._originals = {n: AttentionInterface._global_mapping[n] for n in ("sdpa", "qkv")}
        for name, fn in self._originals.items():
            AttentionInterface.register(name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return timed

    def __exit__(self, *exc):
        from transformers import AttentionInterface
        for name, fn in self._originals.items():
            AttentionInterface.register(name, fn)


def _side_by_side(model, ids, what, repeats: int) -> dict:
    """``what(model, ids)`` on sdpa and on qkv, alternately; the medians (s), the ratio qkv / sdpa, and the median
    time of the attention layers' forward calls within (``attention_*_s``)."""
    times = {"sdpa": [], "qkv": []}
    attn = {"sdpa": [], "qkv": []}
    for r in range(repeats + 1):
        for side in ("sdpa", "qkv"):
            model.set_attn_implementation(side)
            with _AttentionClock() as clock:
                dt = _time(lambda: what(model, ids))
            if r:                                            # the first round warms up
                times[side].append(dt)
                attn[side].append(clock.seconds)
    med = {side: statistics.median(ts) for side, ts in times.items()}
    return {"sdpa_s": med["sdpa"], "qkv_s": med["qkv"], "ratio": med["qkv"] / med["sdpa"],
            "attention_sdpa_s": statistics.median(attn["sdpa"]), "attention_qkv_s": statistics.median(attn["qkv"])}


def run(names, repeats: int) -> dict:
    import qkv.hf

    qkv.hf.register()
    results = {}
    for name in names:
        model, ids = _model(name)
        model.set_attn_implementation("sdpa")
        ref = _forward(model, ids)
        model.set_attn_implementation("qkv")
        diff = float((_forward(model, ids) - ref).abs().max())
        results[name] = {"tokens": ids.shape[1], "max_abs_logits_diff": diff,
                         "forward": _side_by_side(model, ids, _forward, repeats),
                         "train_step": _side_by_side(model, ids, _train_step, repeats)}
        _print(name, results[name])
    return results


def _print(name: str, r: dict) -> None:
    cls, T, extra = MODELS[name]
    shape = f"{name}: 2 layers, width 512, 8 heads, {T:,} tokens" + (
        f", window {extra['sliding_window']}" if extra else "")
    print(f"{shape} (max |Δ logits| qkv vs sdpa {r['max_abs_logits_diff']:.2e})")
    for what in ("forward", "train_step"):
        x = r[what]
        print(f"  {what:<10}  sdpa {x['sdpa_s'] * 1e3:8.1f} ms   qkv {x['qkv_s'] * 1e3:8.1f} ms   "
              f"qkv/sdpa {x['ratio']:.2f}x   (attention forward calls: sdpa {x['attention_sdpa_s'] * 1e3:.1f} ms, "
              f"qkv {x['attention_qkv_s'] * 1e3:.1f} ms)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side (after one warm-up)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads on both sides")
    ap.add_argument("--only", default=",".join(MODELS), help="models to run: llama, mistral")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not 1 <= args.repeats <= 100 or args.threads < 1:
        print(f"bench_hf: expected --only from {', '.join(MODELS)}, --repeats 1 … 100, --threads ≥ 1; got "
              f"{args.only!r}, {args.repeats}, {args.threads}", file=sys.stderr)
        return 2
    import platform

    import torch
    import transformers
    limits = _threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f}")
    results = run(names, args.repeats)
    load = os.getloadavg()[0]
    note = " (above the thread count: the machine was shared, the medians move)" if load > args.threads else ""
    print(f"load average after: {load:.2f}{note}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"threads": args.threads, "results": results}, fh, indent=2)
    del limits
    return 0


if __name__ == "__main__":
    sys.exit(main())
