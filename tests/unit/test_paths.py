"""qkv.paths: the engine's own count of the paths a run took."""
import threading

import numpy as np
import pytest

import qkv
from qkv import paths
from qkv.backends import tiled


def test_counting_sees_what_the_engine_ran_and_nothing_outside_the_block():
    r = np.random.default_rng(0)
    q, k, v = (r.standard_normal((1, 2, 64, 8)) for _ in range(3))
    with paths.counting() as seen:
        tiled.forward(q, k, v, scale=0.3, return_weights=True)
    assert seen["forward.weights"] == 2 and seen["forward.shift_free"] > 0
    with paths.counting() as later:
        pass
    tiled.forward(q, k, v, scale=0.3)
    assert not later


def test_every_hit_is_a_registered_path_with_a_description():
    names = paths.registered()
    assert "forward.plain_loop" in names and "kernel.plain_rows" in names
    assert all(isinstance(d, str) and d for d in names.values())
    with pytest.raises(ValueError, match="already registered"):
        paths.register("forward.plain_loop", "something else")
    with pytest.raises(ValueError, match="no path named"):
        paths.describe("forward.nosuch")
    with paths.counting(), pytest.raises(ValueError, match="not registered"):
        paths.hit("forward.nosuch")


def test_hits_from_worker_threads_are_all_counted():
    with paths.counting() as seen:
        ts = [threading.Thread(target=lambda: [paths.hit("forward.lazy") for _ in range(1000)]) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert seen["forward.lazy"] == 4000


def test_limits_move_the_thresholds_inside_the_block_only():
    before = tiled.current_limits()
    assert before == tiled.Limits() and before.block_q == tiled.BLOCK_Q
    with tiled.limits(block_q=16, kernel_min=0) as lim:
        assert lim.block_q == 16 and tiled.current_limits() is lim and lim.kernel_min == 0
        with tiled.limits(block_k=8) as inner:                  # nested: the outer block's changes kept
            assert (inner.block_q, inner.block_k) == (16, 8)
        assert tiled.current_limits() is lim
    assert tiled.current_limits() == before
    assert tiled.BLOCK_Q == 1024 and qkv.kernels.KERNEL_MIN == 1 << 14     # nothing global rewritten
    with pytest.raises(ValueError, match="unknown nosuch"):
        with tiled.limits(nosuch=1):
            pass


@pytest.mark.parametrize("name", ["block_q", "block_k_plain", "band_rows_plain", "band_keys_plain", "block_q_tiles",
                                  "strip_rows_tiles", "grid_cell", "grid_cell_backward", "diagonal_min_plain"])
def test_a_size_limit_must_be_a_positive_integer(name):
    """A block, band or cell size of 0 would divide by zero or loop for ever in the planner: refused, named."""
    for bad, err in ((0, ValueError), (-4, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match=name):
            with tiled.limits(**{name: bad}):
                pass
    assert tiled.current_limits() == tiled.Limits()              # nothing left set
    with tiled.limits(**{name: 3}) as lim:
        assert getattr(lim, name) == 3


def test_limits_govern_the_calls_inside_the_block_and_only_in_this_thread():
    """A call reads the limits once, at its start: kernel_min=0 takes the fused kernels even for tiny blocks,
    block sizes change the tasks; another thread's calls meanwhile keep the defaults."""
    pytest.importorskip("numba")
    r = np.random.default_rng(1)
    q, k, v = (r.standard_normal((1, 2, 64, 8)).astype(np.float32) for _ in range(3))
    with paths.counting() as seen:
        tiled.forward(q, k, v, scale=0.3, threads=1)
    assert not any(n.startswith("kernel.") for n in seen)          # 64 × 64 blocks: under KERNEL_MIN
    other = []
    with tiled.limits(kernel_min=0, block_q=16, plain_loop=False):
        t = threading.Thread(target=lambda: other.append(tiled.current_limits()))
        t.start()
        t.join()
        with paths.counting() as seen:
            tiled.forward(q, k, v, scale=0.3, threads=1)
    assert other == [tiled.Limits()]
    assert seen["kernel.exp_rows.base2"] == 2 * 4 and seen["forward.shift_free"] == 2 * 4   # 4 tasks a head


def test_limits_follow_work_handed_to_the_runtimes_pool():
    """RUNTIME.map runs each item in a copy of the caller's context: a model's attention calls made by the
    pool's workers plan with the caller's limits."""
    with tiled.limits(block_q=16):
        got = list(tiled.RUNTIME.map(lambda _: tiled.current_limits().block_q, range(4), 2))
    assert got == [16] * 4
    assert list(tiled.RUNTIME.map(lambda _: tiled.current_limits().block_q, range(4), 2)) == [tiled.BLOCK_Q] * 4
