"""The tiled engine merges partial results with qkv.merge.merge_partials, the ring's merge: split-K for
decode-like problems (few query rows, many keys: the key range shared among the workers) and the sinks (one
more partial result, out = 0 and lse = the sink). Each path is shown to be taken (merge_partials counted) and
equal to the reference backend and to the unsplit engine."""
import numpy as np
import pytest

import qkv
from qkv import merge
from qkv.backends import tiled

TILED = tiled.TILED


@pytest.fixture
def merges(monkeypatch):
    """Count the engine's calls of merge_partials (still the real one: split-K's and the sinks'); split-K allowed
    on parts of 1024 keys (by default it waits for 65536 per part, where it pays for itself: test sizes stay
    small)."""
    calls = []

    def counting(*a, **k):
        calls.append(np.shape(a[0]))
        return merge.merge_partials(*a, **k)
    monkeypatch.setattr(tiled.split, "merge_partials", counting)
    monkeypatch.setattr(tiled.forward_pass, "merge_partials", counting)
    with tiled.limits(split_k_min_part_keys=1024):
        yield calls


def _inputs(rng, H=1, Hk=1, L=64, S=8192, E=64, dt=np.float32):
    return (rng.standard_normal((1, H, L, E)).astype(dt), rng.standard_normal((1, Hk, S, E)).astype(dt),
            rng.standard_normal((1, Hk, S, E)).astype(dt))


def _tol(dt):
    return dict(rtol=1e-12, atol=1e-12) if dt == np.float64 else dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["plain", "bool mask", "causal", "gqa"])
def test_split_k_for_decode_like_problems_equals_the_reference(merges, rng, dt, case):
    """One head, 64 query rows, 8192 keys on 2 workers: one task, so the keys are split in two and merged.
    (GQA: the two query heads of the key/value head are one task, their rows interleaved.)"""
    H, Hk, threads = (2, 1, 2) if case == "gqa" else (1, 1, 2)
    q, k, v = _inputs(rng, H=H, Hk=Hk, dt=dt)
    kw = dict(scale=0.125, enable_gqa=case == "gqa", is_causal=case == "causal")
    if case == "bool mask":
        kw["attn_mask"] = rng.random((64, 8192)) > 0.2
    out, _, lse = TILED.forward(q, k, v, return_lse=True, threads=threads, **kw)
    assert merges, "split-K was not taken"
    assert len(merges) == 1 and merges[0] == (1, H, 64, 64)     # two parts, one merge of whole arrays
    ref_out, ref_lse = qkv.scaled_dot_product_attention(q, k, v, backend="reference", return_lse=True, **kw)
    np.testing.assert_allclose(out, ref_out, **_tol(dt))
    np.testing.assert_allclose(lse, ref_lse, **_tol(dt))
    merges.clear()
    one, _, lse1 = TILED.forward(q, k, v, return_lse=True, threads=1, **kw)   # one worker: no split
    assert not merges
    np.testing.assert_allclose(out, one, **_tol(dt))
    np.testing.assert_allclose(lse, lse1, **_tol(dt))


def test_split_k_in_more_parts_with_more_workers(merges, rng):
    q, k, v = _inputs(rng, L=64, S=16384)
    out = TILED.forward(q, k, v, scale=0.125, threads=4)[0]
    assert len(merges) == 3                                      # four parts
    ref = qkv.scaled_dot_product_attention(q, k, v, scale=0.125, backend="reference")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_split_k_not_taken_when_every_worker_has_a_task_or_the_parts_are_too_small(merges, rng, monkeypatch):
    q, k, v = _inputs(rng, H=4, Hk=4, L=64, S=8192)
    TILED.forward(q, k, v, scale=0.125, threads=2)              # 4 tasks for 2 workers
    q, k, v = _inputs(rng, L=8, S=1024, E=16)
    TILED.forward(q, k, v, scale=0.25, threads=2)               # parts under SERIAL_BELOW_FLOPS
    q, k, v = _inputs(rng, L=64, S=8192)
    TILED.forward(q, k, v, scale=0.125, threads=2, return_weights=True)   # weights: a second pass
    TILED.forward(q, k, v, scale=0.125, threads=2, dropout_p=0.5, rng=np.random.default_rng(0))
    with tiled.limits(split_k_min_part_keys=1 << 16):
        TILED.forward(q, k, v, scale=0.125, threads=2)          # parts of 4096 keys: under the default minimum
    assert not merges


@pytest.mark.parametrize("split", [False, True])
def test_sinks_are_merged_as_one_more_partial_result(merges, rng, split):
    """Sinks: out = 0, lse = the sink, merged in — per task, or once after the split parts."""
    H = 2
    q, k, v = _inputs(rng, H=H, Hk=H, L=64, S=8192 if split else 512, dt=np.float64)
    sinks = np.array([0.5, 3.0])
    threads = 4 if split else 1
    out, _, lse = TILED.forward(q, k, v, scale=0.125, sink_logits=sinks, return_lse=True, threads=threads,
                                block_q=64 if not split else None)
    if split:
        assert len(merges) == 2                                  # the two parts, then the sinks
    else:
        assert merges == [(64, 64)] * H                          # per task (a head's 64 rows), its sink
    ref_out, ref_lse = qkv.flex_attention(q, k, v, scale=0.125, sink_logits=sinks, backend="reference",
                                          return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
