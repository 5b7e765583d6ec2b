"""Tests written to kill the mutants that the fast tier let live (issue 39, ``make mutation``; docs/mutation.md).

Each test names what it pins down: split-K's key parts (their count, order and balance), the dtypes and the
``lse`` the split-K forward returns, and the choice of split-K itself (threads, dropout, weights). The mutants
left alive after these are equivalent: docs/mutation.md lists them with why.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import qkv
from qkv.backends.tiled import backend, limits, split
from qkv.backends.tiled.thresholds import current_limits

#: Limits under which a few query rows against a few dozen keys take split-K.
SPLIT_K = dict(kernel_min=0, serial_below_flops=0, split_k_min_blocks=1, split_k_min_part_keys=4)


def _decode(S: int = 100, E: int = 4, dtype=np.float32, seed: int = 0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((1, 1, 1, E)).astype(dtype)
    k, v = (r.standard_normal((1, 1, S, E)).astype(dtype) for _ in range(2))
    return q, k, v


def _reference(q, k, v, scale=0.5):
    s = (q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)) * scale
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    return np.exp(s - lse[..., None]) @ v.astype(np.float64), lse


# ============================================================================================ split-K's bounds
@pytest.mark.parametrize("S, bk, splits", [(100, 8, 4), (100, 8, 2), (25, 8, 2), (64, 16, 4), (9, 8, 2),
                                           (1000, 64, 3), (17, 4, 5)])
def test_split_k_bounds_are_splits_plus_one_increasing_block_edges_that_share_the_blocks_evenly(S, bk, splits):
    bounds = split.key_bounds(SimpleNamespace(S=S), splits, bk)
    assert len(bounds) == splits + 1 and bounds[0] == 0
    assert bounds[-1] >= S and bounds[-2] < S                   # the last part ends at (or past) the keys' end
    inner = bounds[:-1]
    assert all(b % bk == 0 for b in inner), bounds              # parts start at key-block boundaries
    blocks = [(-(-min(b1, S) // bk)) - b0 // bk for b0, b1 in zip(bounds, bounds[1:])]
    assert all(n >= 1 for n in blocks), bounds                  # no part is empty
    assert max(blocks) - min(blocks) <= 1, bounds               # …and they share the blocks evenly


def test_split_k_plan_parts_partition_the_keys_in_order():
    """The plan of a decode-like call under split-K: per head its parts' key ranges follow each other from 0 to S,
    none empty, the count the plan says."""
    q, k, v = _decode(S=100)
    with limits(**SPLIT_K, block_k=8):
        p = qkv.plan(q, k, v, backend="tiled", threads=4)
    assert p.split_k > 1
    ranges = sorted({t.keys for t in p.tasks})
    assert len(ranges) == p.split_k
    assert ranges[0][0] == 0 and ranges[-1][1] >= 100
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
    assert all(k0 < min(k1, 100) for k0, k1 in ranges), ranges


# ======================================================================================== split-K's results
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("return_lse", [False, True])
def test_split_k_returns_the_input_dtype_and_lse_only_when_asked(dtype, return_lse):
    """As the forward's doc says: ``output`` in the input dtype, ``lse`` in the compute dtype (float32 for
    float16/32 inputs) and None unless asked for — under split-K as on the other paths."""
    q, k, v = _decode(S=100, dtype=dtype)
    with limits(**SPLIT_K, block_k=8):
        assert qkv.plan(q, k, v, backend="tiled", threads=4, scale=0.5).split_k > 1
        out, weights, lse = backend.forward(q, k, v, scale=0.5, threads=4, return_lse=return_lse)
    assert out.dtype == dtype and weights is None
    if return_lse:
        assert lse is not None and lse.dtype == np.float32
        ref_out, ref_lse = _reference(q, k, v)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-3 if dtype == np.float16 else 1e-5)
        np.testing.assert_allclose(out, ref_out, atol=2e-3 if dtype == np.float16 else 1e-5)
    else:
        assert lse is None


# ============================================================================= when split-K is taken at all
def _P(L=1, S=100, E=4, Ev=4, **lim):
    with limits(**{**SPLIT_K, **lim}):
        return SimpleNamespace(L=L, S=S, E=E, Ev=Ev, limits=current_limits())


@pytest.mark.parametrize("threads, n_tasks, dropout_p, weights, want", [
    (1, 1, 0.0, False, 1),          # one worker: nothing to share
    (4, 4, 0.0, False, 1),          # as many tasks as workers: every worker has one already
    (4, 5, 0.0, False, 1),
    (4, 1, 0.1, False, 1),          # dropout: its mask is drawn per task
    (4, 1, 0.0, True, 1),           # weights: a second pass over all keys
    (4, 1, 0.0, False, 4),
    (2, 1, 0.0, False, 2),          # two workers, one task: the common decode
    (4, 2, 0.0, False, 2),          # ceil(threads / tasks)
    (3, 2, 0.0, False, 2),
])
def test_key_splits_follows_its_rule(threads, n_tasks, dropout_p, weights, want):
    assert split._key_splits(_P(), n_tasks, threads, 1, 8, dropout_p, weights) == want


def test_key_splits_is_bounded_by_blocks_part_keys_and_the_work_a_part_pays_for():
    assert split._key_splits(_P(split_k_min_blocks=5), 1, 8, 1, 8, 0.0, False) == 13 // 5     # 13 key blocks
    got = split._key_splits(_P(split_k_min_blocks=1), 1, 16, 1, 8, 0.0, False)
    assert got == 13 and isinstance(got, int)                   # the last, partial block counts: one part each
    assert split._key_splits(_P(split_k_min_part_keys=30), 1, 8, 1, 8, 0.0, False) == 100 // 30
    # each part must still cost 2·rows·keys·(E + Ev) ≥ serial_below_flops: 2·1·(100/s)·8 = 1600/s flops
    assert split._key_splits(_P(serial_below_flops=400), 1, 8, 1, 8, 0.0, False) == 4
    assert split._key_splits(_P(serial_below_flops=401), 1, 8, 1, 8, 0.0, False) == 3
    assert split._key_splits(_P(serial_below_flops=1601), 1, 8, 1, 8, 0.0, False) == 1
    assert split._key_splits(_P(L=3, serial_below_flops=1201), 1, 8, 2, 8, 0.0, False) == 2   # min(bq, L) rows
