"""qkv's decoder against llama.cpp (llama-cpp-python, the ``bench`` extra) on the same GGUF file and threads.

Run through ``benchmarks/bench_llama.py --only llamacpp``. Each side once to warm up, then ``repeats`` times
alternately, each call after a ``settle`` pause; medians and their ratio. Both sides get the same token ids
(no sampling: greedy, argmax of the last logits):

* decode at a context of C tokens (30 and 4,096): C tokens are prefilled (not timed), then ``new_tokens``
  single-token steps are timed (each step's logits → argmax → the next step);
* prefill of 512 and 4,096 tokens into an empty cache, the last token's logits.

The machine's memory rate is measured (NumPy/BLAS ``A @ x`` over a 512 MiB float32 matrix, all threads: a
read of every byte once), and each side's decode is put as a share of it: the bytes a token must read (the
weights as each side holds them, plus its KV cache at that context) × tokens/s ÷ the rate.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

CONTEXTS = (30, 4096)
PREFILLS = (512, 4096)


def memory_rate(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second read by ``A @ x`` (float32, ``mib`` MiB, BLAS on ``threads`` threads), best of ``repeats``."""
    from threadpoolctl import threadpool_limits
    n = 4096
    a = np.ones((mib * 2**20 // 4 // n, n), np.float32)
    x = np.ones(n, np.float32)
    best = float("inf")
    with threadpool_limits(limits=threads, user_api="blas"):
        for _ in range(repeats):
            t = time.perf_counter()
            a @ x
            best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def file_weight_bytes(path) -> int:
    """The bytes of the file's tensors that one token reads (all of them: the output matmul reads the whole
    embedding matrix when the head is tied; the lookup reads one row, counted with the rest)."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    return int(sum(t.n_bytes for t in reader.tensors))


def _llama(path, threads: int, n_ctx: int, flash_attn: bool = True):
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 flash_attn=flash_attn, verbose=False, seed=0)


class LlamaCppSide:
    """llama.cpp through llama-cpp-python's low-level ``eval``: the same steps as qkv's ``step``."""

    name = "llama.cpp"

    def __init__(self, path, threads: int, n_ctx: int, flash_attn: bool = True):
        self.llm = _llama(path, threads, n_ctx, flash_attn)

    def _last_logits(self) -> np.ndarray:
        """The last evaluated token's logits, read from llama.cpp's context (llama-cpp-python's ``eval`` keeps
        them in ``scores`` only with ``logits_all``)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))

    def prefill(self, ids) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(list(map(int, ids)))
        return self._last_logits().copy()

    def decode(self, first: int, n: int) -> list[int]:
        out, tok = [], first
        for _ in range(n):
            self.llm.eval([tok])
            tok = int(np.argmax(self._last_logits()))
            out.append(tok)
        return out

    def kv_bytes_per_token(self, config) -> int:
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2        # float16 K and V

    def __repr__(self):
        return "llama.cpp (flash attention on, F16 KV cache)"


class QkvSide:
    """qkv's LlamaModel: ``step(ids, caches)``."""

    name = "qkv"

    def __init__(self, model, kv_dtype=None):
        self.model, self.kv_dtype, self.caches = model, kv_dtype, None

    def _new(self):
        return self.model.new_caches() if self.kv_dtype is None else self.model.new_caches(dtype=self.kv_dtype)

    def prefill(self, ids) -> np.ndarray:
        self.caches = self._new()
        return self.model.step(np.asarray(ids)[None, :], self.caches)[0]

    def decode(self, first: int, n: int) -> list[int]:
        out, tok = [], first
        for _ in range(n):
            logits = self.model.step(np.array([[tok]]), self.caches)
            tok = int(np.argmax(logits[0]))
            out.append(tok)
        return out

    def kv_bytes_per_token(self, config) -> int:
        item = np.dtype(self.kv_dtype or np.float32).itemsize
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * item

    def __repr__(self):
        return (f"qkv (activations {self.model.activations}, KV cache {np.dtype(self.kv_dtype or np.float32)})")


#: the five prompts of tests/integration/test_llama_quant.py
PROMPTS = ("The animal didn't cross the street because it was too tired. It", "我们在北京学习中文，因为",
           "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "I love pizza 🍕 and sunshine ☀️! My favourite emoji is 👍🏽 because", "The capital of France is")


def agreement(path, model, threads: int, new_tokens: int = 16, kv_dtype=None) -> list[str]:
    """Greedy continuations of :data:`PROMPTS` on both sides (the same token ids in), and the largest
    difference of the prompts' last logits: how far llama.cpp's rounding (it quantizes the activations to
    8 bits for its dot products) moves them from qkv's."""
    cpp, ours = LlamaCppSide(path, threads, 512), QkvSide(model, kv_dtype)
    lines, worst = [], 0.0
    for prompt in PROMPTS:
        ids = model.encode(prompt)
        a, b = ours.prefill(ids), cpp.prefill(ids)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
        ga = ours.decode(int(np.argmax(a)), new_tokens)
        gb = cpp.decode(int(np.argmax(b)), new_tokens)
        first = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)
        lines.append(f"  {prompt[:40]!r}: {'identical' if first is None else f'first differs at new token {first}'}"
                     f" ({new_tokens} greedy tokens; argmax after the prompt equal {int(np.argmax(a)) == int(np.argmax(b))})")
    lines.insert(0, f"greedy continuations, qkv (weights as stored) and llama.cpp; the prompts' last logits differ "
                    f"by at most {worst:.1%} of their largest:")
    lines.append(_self_agreement(path, model, threads, new_tokens, cpp))
    print("\n".join(lines), flush=True)
    return lines


def _self_agreement(path, model, threads: int, new_tokens: int, cpp) -> str:
    """llama.cpp with flash attention off against on: how far its own rounding moves it (the yardstick)."""
    off = LlamaCppSide(path, threads, 512, flash_attn=False)
    same, worst = 0, 0.0
    for prompt in PROMPTS:
        ids = model.encode(prompt)
        a, b = cpp.prefill(ids), off.prefill(ids)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
        same += cpp.decode(int(np.argmax(a)), new_tokens) == off.decode(int(np.argmax(b)), new_tokens)
    return (f"  llama.cpp with flash attention off against on: {same} of {len(PROMPTS)} continuations identical; "
            f"last logits differ by at most {worst:.1%} of their largest")


def _median_pair(fa, fb, repeats: int, settle: float) -> tuple[float, float]:
    """The medians of the seconds ``fa`` and ``fb`` return, each run once to warm up, then ``repeats`` times
    alternately, each after a ``settle`` pause."""
    ta, tb = [], []
    fa(), fb()                                                               # warm-up
    for _ in range(repeats):
        for f, ts in ((fa, ta), (fb, tb)):
            time.sleep(settle)
            ts.append(f())
    return statistics.median(ta), statistics.median(tb)


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def run(path, model, threads: int, repeats: int, settle: float, new_tokens: int, kv_dtype=None,
        text_ids=None) -> list[str]:
    """The side-by-side lines (also printed as they come)."""
    c = model.config
    rate = memory_rate(threads)
    weights_file = file_weight_bytes(path)
    weights_qkv = getattr(model, "weight_bytes", lambda: None)() or weights_file
    lines = [f"memory rate (A @ x, 512 MiB float32, {threads} threads): {rate / 1e9:.1f} GB/s; weights per token: "
             f"llama.cpp {weights_file / 2**20:.0f} MiB (the file), qkv {weights_qkv / 2**20:.0f} MiB"]
    print(lines[-1], flush=True)
    need = max(CONTEXTS + PREFILLS) + new_tokens + 8
    ids_all = np.asarray(text_ids if text_ids is not None else
                         np.random.default_rng(0).integers(100, c.vocab_size, need), dtype=np.int64)[:need]
    cpp, ours = LlamaCppSide(path, threads, need), QkvSide(model, kv_dtype)
    for ctx in CONTEXTS:
        ids = ids_all[:ctx]
        got = {}

        def side(s):
            def f():
                logits = s.prefill(ids)                                     # not timed: the context
                return _timed(lambda: got.__setitem__(s.name, s.decode(int(np.argmax(logits)), new_tokens)))
            return f
        mq, mc = _median_pair(side(ours), side(cpp), repeats, settle)
        need = lambda s: (weights_qkv if s is ours else weights_file) + s.kv_bytes_per_token(c) * ctx  # noqa: E731
        same = sum(a == b for a, b in zip(got["qkv"], got["llama.cpp"]))
        lines.append(f"decode at {ctx:>5} tokens of context: qkv {new_tokens / mq:6.1f} tokens/s "
                     f"({need(ours) * new_tokens / mq / rate:.0%} of the memory rate), llama.cpp "
                     f"{new_tokens / mc:6.1f} tokens/s ({need(cpp) * new_tokens / mc / rate:.0%}); "
                     f"ratio qkv/llama.cpp {mc / mq:.2f}x; greedy tokens equal {same}/{new_tokens}")
        print(lines[-1], flush=True)
    for n in PREFILLS:
        ids = ids_all[:n]
        out = {}
        mq, mc = _median_pair(lambda: _timed(lambda: out.__setitem__("q", ours.prefill(ids))),
                              lambda: _timed(lambda: out.__setitem__("c", cpp.prefill(ids))), repeats, settle)
        d = np.abs(out["q"] - out["c"]).max()
        lines.append(f"prefill {n:>5} tokens: qkv {mq:.3f} s, llama.cpp {mc:.3f} s; ratio qkv/llama.cpp "
                     f"{mq / mc:.2f}x (target <= 1.0); max |Δ last logits| {d:.2e}, argmax equal "
                     f"{int(np.argmax(out['q'])) == int(np.argmax(out['c']))}")
        print(lines[-1], flush=True)
    return lines
