"""qkv.distributed.launch when one rank fails: the error names that rank and its own error first, at once —
not the ranks that waited for it in a collective (whose RingError says the peer went away, not a timeout it
never reached), and a rank still busy is stopped rather than waited for."""
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def _rank1_fails(rank, world, busy):
    """Rank 1 stops with its own error before the ring; rank 0 waits for it in the ring's first collective
    (or, ``busy``, computes on without communicating)."""
    from qkv.distributed import ring_attention, shard
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("rank one's own problem")
    if busy:
        time.sleep(60)
    x = np.random.default_rng(0).standard_normal((1, 8, 4))
    sh = shard(x, rank, world, layout="contiguous")
    return ring_attention(sh, sh, sh, layout="contiguous", timeout=60.0)


@pytest.mark.parametrize("busy", [False, True], ids=["waiting", "busy"])
def test_a_failed_rank_is_reported_first_and_the_others_stopped(busy):
    from qkv.distributed import launch
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        launch(_rank1_fails, 2, (busy,), timeout=60.0, deadline=90.0, quiet=True)
    took = time.monotonic() - t0
    msg = str(err.value)
    assert msg.startswith("rank 1 failed after "), msg
    assert "s: ValueError: rank one's own problem; rank 0 " in msg, msg
    assert "within 60 s" not in msg, msg                  # no timeout was reached
    if busy:
        assert msg.endswith("rank 0 stopped: still running 2 s after rank 1 failed (waiting for it)"), msg
    else:
        assert "rank 0 failed after" in msg and "RingError: ring_attention: rank 0: the check before the ring " \
            "failed after" in msg and "another rank stopped or crashed" in msg, msg
    assert len(msg) < 700, msg
    assert took < 30, took                                # neither rank 0's 60 s timeout nor its sleep
