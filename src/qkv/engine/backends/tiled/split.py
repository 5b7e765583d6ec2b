"""Split-K (flash-decoding): a decode-like problem's key range shared among the workers.

A problem with fewer (head, query block) tasks than workers — decoding, few query rows against many keys — has
each task's key range split at key-block boundaries into parts (at least ``split_k_min_blocks`` blocks and
``split_k_min_part_keys`` keys each, and only while a part still pays for a worker: ``serial_below_flops``);
each part is a forward task over its keys alone (``keys=(k0, k1)``: the same strategies, without sinks)
writing its own partial ``(out, lse)``. The parts are merged by log-sum-exp (:func:`qkv.merge.merge_partials`,
the ring's merge too), then the sinks merged in as one more part (``out = 0``, ``lse = sink``). Not with dropout
(its mask is drawn per task) or weights (a second pass over all keys). The key/value heads are prepared by key
ranges in parallel too (:meth:`qkv.backends.tiled.plan._Problem.prepare_kv_split`): with few query rows that
preparation costs as much as the attention.
"""
from __future__ import annotations

import numpy as np

from qkv.compute import paths as _paths
from qkv.core.merge import merge_partials
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled import forward_pass as _fp
from qkv.engine.backends.tiled.forward_pass import F_SINKS

F_SPLIT_K = _paths.register("forward.split_k", "the key range split among workers, parts merged by log-sum-exp")


def _key_splits(P, n_tasks: int, threads: int, bq: int, bk: int, dropout_p, weights: bool) -> int:
    """Into how many key ranges each task is split (1: none). Decode-like problems (few query rows, many keys:
    fewer tasks than workers) split so every worker has a share; not with dropout (its mask is drawn per
    task) or weights (a second pass over all keys), and only while each part still pays for a worker
    (``serial_below_flops``)."""
    lim = P.limits
    if threads <= 1 or n_tasks >= threads or dropout_p > 0 or weights:
        return 1
    splits = min(-(-threads // n_tasks), -(-P.S // bk) // lim.split_k_min_blocks,
                 P.S // lim.split_k_min_part_keys)
    while splits > 1 and 2 * min(bq, P.L) * (P.S / splits) * (P.E + P.Ev) < lim.serial_below_flops:
        splits -= 1
    return max(1, splits)


def key_bounds(P, splits: int, bk: int) -> list:
    """The ``splits + 1`` key boundaries of split-K's parts, at key-block boundaries."""
    n_blocks = -(-P.S // bk)
    bounds = [round(n_blocks * c / splits) * bk for c in range(splits + 1)]
    bounds[-1] = max(bounds[-1], P.S)
    return bounds


def _forward_split(P, plan: list, splits: int, bk: int, threads: int, dt, return_lse: bool):
    """Split-K: every task's key range in ``splits`` parts (``plan``: ``(idx, i0, i1, (k0, k1))`` part by part,
    at key-block boundaries: :func:`qkv.backends.tiled.setup.forward_setup`'s), each part a task writing its own
    ``(out, lse)``; the parts merged by log-sum-exp (:func:`qkv.merge.merge_partials`, the ring's merge too), then
    the sinks merged in as one more part (out = 0, lse = sink)."""
    bounds = key_bounds(P, splits, bk)
    outs = np.zeros((splits,) + P.lead + (P.L, P.Ev), P.cdt)
    lses = np.full((splits,) + P.lead + (P.L,), -np.inf, P.cdt)
    part_of = {b: c for c, b in enumerate(bounds[:-1])}
    parts = [(P, idx, i0, i1, bk, outs[part_of[keys[0]]], lses[part_of[keys[0]]], None, 0.0, 0, keys)
             for idx, i0, i1, keys in plan]
    P.prepare_kv_split({idx for idx, *_ in plan}, bounds, threads)
    _paths.hit(F_SPLIT_K)
    RUNTIME.run(parts, _fp._forward_task, threads)
    out, lse = outs[0], lses[0]
    for c in range(1, splits):
        merge_partials(out, lse, outs[c], lses[c], out=(out, lse))
    if P.sinks is not None:
        _paths.hit(F_SINKS)
        sink = np.empty_like(lse)
        for idx in np.ndindex(*P.lead):
            sink[idx] = P.sinks[P.bh(idx)[1]]
        merge_partials(out, lse, np.zeros_like(out), sink, out=(out, lse))
    return out.astype(dt, copy=False), None, lse if return_lse else None
