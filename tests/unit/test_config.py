"""qkv.config (issue 42): one configuration — GEMM provider, block kernels, worker threads, limits — in one
context variable over one process default (what qkv.set_* write); the runtime owns resources only, its caches
bounded and locked."""
import threading

import numpy as np
import pytest

import qkv
from qkv import _settings, gemm, kernels
from qkv.backends import configuration, runtime, tiled
from qkv.backends.runtime import RUNTIME


@pytest.fixture(autouse=True)
def _process_default_restored():
    saved = _settings.process_default()
    yield
    _settings.set_default(**{f: getattr(saved, f) for f in ("gemm", "kernels", "threads", "limits")})


def test_nested_blocks_compose_and_restore():
    outside = configuration.current()
    with qkv.config(kernels="numpy", limits={"block_q": 64}) as s:
        assert (s.kernels, s.limits.block_q) == ("numpy", 64)
        with qkv.config(threads=1, limits={"block_k": 32}) as inner:
            assert (inner.kernels, inner.threads) == ("numpy", 1)                    # the outer's kept
            assert (inner.limits.block_q, inner.limits.block_k) == (64, 32)           # limits moved on the outer's
            assert kernels.get_kernels() == "numpy" and qkv.get_num_threads() == 1
            with tiled.limits(block_q=16) as lim:                                     # tiled.limits is config(limits=)
                assert (lim.block_q, lim.block_k) == (16, 32)
            assert tiled.current_limits().block_q == 64
        assert configuration.current().threads == outside.threads
    assert configuration.current() == outside


def test_set_functions_write_the_process_default_a_block_overrides_it():
    qkv.set_num_threads(3)
    assert _settings.process_default().threads == 3 and RUNTIME.threads == 3
    with qkv.config(threads=1):
        assert qkv.get_num_threads() == 1
        qkv.set_num_threads(2)                                                        # the default moves …
        assert qkv.get_num_threads() == 1                                             # … the block still rules
    assert qkv.get_num_threads() == 2
    qkv.set_kernels("numpy")
    assert _settings.process_default().kernels == "numpy" and kernels.KERNELS.choice == "numpy"
    with qkv.config(kernels="auto"):
        assert kernels.KERNELS.choice == "auto"
    qkv.set_kernels(kernels.KERNELS.initial)                                          # the environment's: not set
    assert _settings.process_default().kernels is None
    qkv.set_num_threads(None)
    assert _settings.process_default().threads is None


def test_the_gemm_choice_of_a_block_reaches_the_matmuls():
    calls = []
    numpy_p = gemm.GEMM.provider("numpy")
    a = np.ones((300, 300), np.float32)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(numpy_p, "matmul", lambda x, y, out=None: (calls.append(x.shape), np.matmul(x, y, out=out))[1])
        with qkv.config(gemm="numpy"):
            assert qkv.get_gemm() == "numpy"
            np.testing.assert_array_equal(gemm.matmul(a, a), a @ a)
    assert calls == [(300, 300)]
    if "mkl" in gemm.GEMM.available():
        with qkv.config(gemm="mkl"):
            assert qkv.get_gemm() == "mkl" and gemm.GEMM.choice == "mkl"
        assert gemm.GEMM.choice == gemm.GEMM.initial                                 # nothing of the process moved


def test_workers_see_the_configuration_their_task_was_started_with():
    seen = []
    lock = threading.Lock()

    def task(i):
        s = configuration.current()
        with lock:
            seen.append((i, threading.current_thread().name, s.kernels, s.limits.block_q))

    tasks = [(i,) for i in range(8)]
    with qkv.config(kernels="numpy", limits={"block_q": 48}):
        RUNTIME.run(tasks, task, 2)
    assert sorted(i for i, *_ in seen) == list(range(8))
    assert {(k, b) for _, _, k, b in seen} == {("numpy", 48)}
    assert any(name.startswith(RUNTIME.WORKER_PREFIX) for _, name, _, _ in seen)     # a worker, not inline
    RUNTIME.run(tasks, task, 2)                                                       # a later call: its own
    assert {b for *_, b in seen[8:]} == {tiled.Limits().block_q}


def test_threads_keep_their_own_blocks_at_the_same_time():
    barrier = threading.Barrier(2)
    got = {}

    def caller(n):
        with qkv.config(threads=n, limits={"block_q": 8 * n}):
            barrier.wait()                                                            # both blocks open at once
            got[n] = (qkv.get_num_threads(), tiled.current_limits().block_q)
            barrier.wait()

    ts = [threading.Thread(target=caller, args=(n,)) for n in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got == {1: (1, 8), 2: (2, 16)}


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"gemm: expected one of \('auto', 'numpy', 'mkl'\), got 'blis'"):
        qkv.config(gemm="blis").__enter__()
    with pytest.raises(TypeError, match="kernels: expected a str"):
        qkv.config(kernels=1).__enter__()
    with pytest.raises(ValueError, match="threads: expected an integer >= 1, got 0"):
        qkv.config(threads=0).__enter__()
    with pytest.raises(ValueError, match="limits: unknown nope"):
        qkv.config(limits={"nope": 1}).__enter__()
    with pytest.raises(TypeError, match="limits: expected a qkv.backends.tiled.Limits or a dict"):
        qkv.config(limits=3).__enter__()
    with pytest.raises(TypeError, match="config: unknown colour"):
        _settings.override(colour="red").__enter__()
    assert _settings.overrides() == {}                                                # nothing was entered


def test_the_runtime_caches_are_bounded_and_locked():
    memo = runtime.Memo(2)
    assert [memo.get(k, lambda k=k: k * 10) for k in (1, 2, 1)] == [10, 20, 10] and len(memo) == 2
    assert memo.get(3, lambda: 30) == 30 and len(memo) == 1                           # full: started again
    assert memo.get(3, lambda: pytest.fail("computed twice")) == 30
    from qkv.backends.tiled import scoring
    coef = scoring._tanh_poly(0.5)
    assert RUNTIME.memo.get(("tanh_poly", 0.5), lambda: pytest.fail("not kept")) is coef
    assert len(coef) == 5                                                             # 5 terms up to Y = 1/2
    plans = runtime.PlanCache()
    plans.MAX_ITEMS = 2
    plans["a"], plans["b"], plans["b"] = 1, 2, 3                                     # a key stored again: kept
    assert dict(plans) == {"a": 1, "b": 3}
    plans["c"] = 4                                                                    # full: started again
    assert dict(plans) == {"c": 4}
    hint = runtime.Hint()
    hint.set(True)
    assert hint.get() is True
