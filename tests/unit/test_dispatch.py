"""Backend dispatch: the auto size rule, forced backends, torch tensors, return_lse, threads, bad input."""
import os
import subprocess
import sys

import numpy as np
import pytest

import qkv
from qkv.backends import tiled

attention_mod = qkv.backends                                  # choose_auto lives with the backends


def _qkv(rng, shape, dtype=np.float32):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


def test_auto_rule_by_size(rng):
    small = np.zeros((2, 4, 64, 8), np.float32)
    assert attention_mod.choose_auto(small, small, small) == "reference"
    big = np.zeros((1, 8, 512, 8), np.float32)                   # 8·512·512 = 2M scores
    assert attention_mod.choose_auto(big, big, big) == "tiled"
    kv = np.zeros((1, 2, 512, 8), np.float32)                    # grouped-query: counts the query heads
    assert attention_mod.choose_auto(big, kv, kv) == "tiled"
    one_head = np.zeros((1, 1, 725, 8), np.float32)              # 725² ≥ 2^19 scores in one head
    assert attention_mod.choose_auto(one_head, one_head, one_head) == "tiled"
    many_small = np.zeros((32, 12, 128, 8), np.float32)          # 6M scores, 16K per head: reference
    assert attention_mod.choose_auto(many_small, many_small, many_small) == "reference"
    few_keys = np.zeros((1, 1, 100_000, 8), np.float32)
    k = np.zeros((1, 1, 16, 8), np.float32)                      # 1.6M scores but only 16 keys
    assert attention_mod.choose_auto(few_keys, k, k) == "reference"
    decode = np.zeros((1, 8, 1, 8), np.float32)                  # one query over 200K cached keys
    cache = np.zeros((1, 8, 200_000, 8), np.float32)
    assert attention_mod.choose_auto(decode, cache, cache) == "tiled"


def test_trace_forces_reference_and_rejects_other_backends(rng):
    q, k, v = _qkv(rng, (1, 8, 512, 16))
    with qkv.trace() as t:
        qkv.scaled_dot_product_attention(q, k, v)
    assert "weights" in [s.name for s in t]
    with pytest.raises(ValueError, match="backend"):
        qkv.scaled_dot_product_attention(q, k, v, backend="tiled", trace=qkv.Trace())


@pytest.mark.parametrize("backend, err", [("flash", ValueError), ("", ValueError), (3, TypeError),
                                          ("Tiled", ValueError)])
def test_invalid_backend_names(backend, err):
    q = np.zeros((2, 3, 4))
    with pytest.raises(err, match="backend") as e:
        qkv.scaled_dot_product_attention(q, q, q, backend=backend)
    if err is ValueError:
        assert "reference" in str(e.value) and "tiled" in str(e.value) and "torch" in str(e.value)


@pytest.mark.parametrize("n, err", [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("2", TypeError),
                                    (True, TypeError)])
def test_invalid_thread_counts(n, err):
    with pytest.raises(err, match="n"):
        qkv.set_num_threads(n)
    q = np.zeros((2, 3, 4))
    with pytest.raises(err, match="threads"):
        tiled.forward(q, q, q, scale=1.0, threads=n)
    assert qkv.get_num_threads() == tiled.default_num_threads()


def test_importing_the_engine_does_not_import_torch():
    code = ("import sys, numpy as np, qkv, qkv.backends.torch_backend; q = np.zeros((1, 8, 512, 8)); "
            "qkv.scaled_dot_product_attention(q, q, q, backend='tiled'); "
            "print(sorted(qkv.backends.names()), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['reference', 'tiled', 'torch'] False"


def test_works_without_threadpoolctl(rng, monkeypatch):
    q, k, v = _qkv(rng, (2, 40, 8))
    want = tiled.forward(q, k, v, scale=0.3, block_q=8, threads=2)[0]
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)       # import threadpoolctl -> ImportError
    monkeypatch.setattr(tiled.RUNTIME, "_controller", None)
    got = tiled.forward(q, k, v, scale=0.3, block_q=8, threads=2)[0]
    np.testing.assert_array_equal(got, want)


def test_mha_large_input_without_weights_takes_the_tiled_path(rng, monkeypatch):
    mha = qkv.MultiHeadAttention(64, 8, seed=0)
    x = rng.standard_normal((1, 512, 64)).astype(np.float32)
    want, _ = mha(x, is_causal=True)
    seen = []
    real = qkv.backends.BACKENDS["tiled"]
    monkeypatch.setitem(qkv.backends.BACKENDS, "tiled", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    got, w = mha(x, is_causal=True)
    assert w is None and len(seen) == 1 and seen[0]["return_weights"] is False
    np.testing.assert_array_equal(got, want)


def test_readme_engine_section_examples_run():
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- BEGIN section:engine -->(.*?)<!-- END section:engine -->", text, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/engine.md", "exec"), {})


def test_engine_called_from_many_threads_and_from_its_own_workers(rng):
    from concurrent.futures import ThreadPoolExecutor
    q, k, v = _qkv(rng, (2, 3, 64, 8))
    want = tiled.forward(q, k, v, scale=0.3, block_q=16, threads=1)[0]
    with ThreadPoolExecutor(4) as ex:                              # concurrent callers share the pool
        outs = list(ex.map(lambda _: tiled.forward(q, k, v, scale=0.3, block_q=16, threads=2)[0], range(8)))
    for o in outs:
        np.testing.assert_allclose(o, want, atol=1e-6)
    pool = tiled.RUNTIME.pool(2)                                   # a task that calls the engine again
    got = pool.submit(lambda: tiled.forward(q, k, v, scale=0.3, block_q=16, threads=2)[0]).result(timeout=30)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_small_tasks_run_on_one_thread(rng, monkeypatch):
    seen = []
    real = tiled.RUNTIME.run
    monkeypatch.setattr(tiled.RUNTIME, "run",
                        lambda tasks, fn, threads: seen.append(threads) or real(tasks, fn, threads))
    small = _qkv(rng, (2, 4, 64, 16))                             # 2·64·64·32 flops per task: serial
    big = _qkv(rng, (1, 2, 1024, 64))                            # 2·512·1024·128 flops per task: the pool
    tiled.forward(*small, scale=0.25, threads=2)
    tiled.forward(*big, scale=0.125, threads=2)
    assert seen == [1, 2]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 CPUs")
def test_pool_workers_are_pinned_one_per_cpu():
    import threading
    pool = tiled.RUNTIME.pool(2)
    barrier = threading.Barrier(2, timeout=10)

    def where():
        barrier.wait()                                             # both workers take one task each
        return tuple(sorted(os.sched_getaffinity(0)))

    got = sorted(pool.map(lambda _: where(), range(2)))
    assert all(len(g) == 1 for g in got) and got[0] != got[1]     # one CPU each, not the same one
    assert len(os.sched_getaffinity(0)) >= 2                       # the calling thread is not pinned


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_engine_works_in_a_forked_child(rng):
    import multiprocessing as mp
    q, k, v = _qkv(rng, (1, 2, 1024, 32))
    want = tiled.forward(q, k, v, scale=0.2, threads=2)[0]       # the parent's pool exists now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as p:
        got = p.apply_async(tiled.forward, (q, k, v), dict(scale=0.2, threads=2)).get(timeout=20)[0]
    np.testing.assert_allclose(got, want, atol=1e-6)
