"""What each ring step computes (NumPy only; shared by the ring and its explainer trace).

At step s rank r holds the K/V block of rank ``src = (r − s) mod P``. Both shards are runs of global
positions (:func:`qkv.distributed._layout.segments`); every (query run, key run) pair is

* empty — no query of the run may see a key of the run (a causal pair above the diagonal, a window or a
  document that does not reach): skipped;
* full — every query sees every key: computed without any mask;
* the diagonal of a causal mask (the same run on both sides): the engine's own ``is_causal``;
* partial under a mask mod: a :class:`qkv.BlockMask` of the mod moved to the pair's global positions,
  so the engine skips its empty cells and masks only its partial ones.

Pairs are fused into as few engine calls as possible: the causal step a rank spends on its own block is one
``is_causal`` call over the whole shard in either layout (local order is global order); the zigzag steps are
one rectangle each (all queries × the first half of the block, or the second half of the queries × all of
it), as in ring-flash-attention. A step with nothing to compute is skipped; the ring runs only as many steps
as the rank that needs the most (a sliding window of w ≤ N/P positions in the contiguous layout: 2 steps).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from qkv.core import mods as _mods
from qkv.core.blockmask import EMPTY, FULL, create_block_mask
from qkv.integrations.distributed._layout import segments


class Block(NamedTuple):
    """One engine call of a ring step: local query rows q0…q1 × local rows k0…k1 of the held K/V block.

    ``kind`` "full" (nothing masked), "causal" (top-left causal: the diagonal of the same positions) or
    "mask" (``block_mask`` covers it); ``qg``/``kg`` the global position of row q0 / k0."""
    q0: int
    q1: int
    k0: int
    k1: int
    kind: str
    block_mask: object
    qg: int
    kg: int


def effective_mod(is_causal: bool, mask_mod):
    """The mask mod the ring applies on global positions: ``mask_mod`` (and-ed with causal when both), or
    None for plain / causal-only attention (those are planned by arithmetic)."""
    if mask_mod is None:
        return None
    mod = _mods.as_mask_mod(mask_mod, "mask_mod")
    return _mods.and_masks(_mods.causal(), mod) if is_causal else mod


def shifted(mod, dq: int, dk: int):
    """``mod`` seen from a block whose local query 0 is global position ``dq`` and local key 0 is ``dk``."""
    def ring_block_mask(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx + dq, kv_idx + dk)

    def kinds(q0, q1, k0, k1):
        return mod.block_kinds(q0 + dq, q1 + dq, k0 + dk, k1 + dk)
    return _mods.MaskMod(ring_block_mask, name=mod.name, params=dict(mod.params), block_kinds=kinds)


def _bh(mod, lead: tuple):
    """(B, H) to build a block mask with: None (broadcast) where the mod's block structure does not depend
    on the batch row or head (every built-in but per-batch documents), else the input's."""
    B = math.prod(lead[:-1]) if len(lead) > 1 else None
    H = lead[-1] if lead else None
    z = np.zeros((1, 1), np.int64)
    got = mod.block_kinds(z, z + 1, z, z + 1)
    if got is not None and all(np.ndim(a) <= 2 for a in got):
        return None, None
    return B, H


def _pair(qa, qb, qg, ka, kb, kg, is_causal: bool, mod, lead):
    """The kind of one (query run, key run) pair: None (empty), "full", "causal" or ("mask", BlockMask)."""
    lq, lk = qb - qa, kb - ka
    if mod is None:
        if not is_causal:
            return "full"
        if qg + lq - 1 < kg:
            return None                                # every key after every query
        if qg >= kg + lk - 1:
            return "full"                              # every key at or before every query
        return "causal"                                # the same run (equal chunks, aligned)
    B, H = _bh(mod, lead)
    bm = create_block_mask(shifted(mod, qg, kg), B, H, lq, lk)
    if (bm.kinds == EMPTY).all():
        return None
    if (bm.kinds == FULL).all():
        return "full"
    return ("mask", bm)


def plan_step(rank: int, src: int, world_size: int, n: int, layout: str, is_causal: bool, mod,
              lead: tuple) -> list[Block]:
    """The engine calls rank ``rank`` makes on the K/V block of rank ``src`` (empty: nothing to compute).

    ``n`` rows per rank; ``mod`` from :func:`effective_mod` (None: plain or causal-only); ``lead`` the
    broadcast leading dims of the scores (for a block mask that depends on the batch row or head)."""
    qs = segments(rank, world_size, n, layout)
    ks = segments(src, world_size, n, layout)
    kinds = {}
    for i, (qa, qb, qg) in enumerate(qs):
        for j, (ka, kb, kg) in enumerate(ks):
            kinds[i, j] = _pair(qa, qb, qg, ka, kb, kg, is_causal, mod, lead)
    live = {p: k for p, k in kinds.items() if k is not None}
    if not live:
        return []
    if mod is None and is_causal and src == rank:
        # every pair is empty, full or a diagonal and local order is global order: one is_causal call
        return [Block(0, n, 0, n, "causal", None, qs[0][2], ks[0][2])]
    calls: list[Block] = []
    for i, (qa, qb, qg) in enumerate(qs):
        js = sorted(j for (a, j) in live if a == i)
        if js and all(live[i, j] == "full" for j in js) and js == list(range(js[0], js[-1] + 1)):
            calls.append(Block(qa, qb, ks[js[0]][0], ks[js[-1]][1], "full", None, qg, ks[js[0]][2]))
            continue
        for j in js:
            k = live[i, j]
            ka, kb, kg = ks[j]
            if isinstance(k, tuple):
                calls.append(Block(qa, qb, ka, kb, "mask", k[1], qg, kg))
            else:
                calls.append(Block(qa, qb, ka, kb, k, None, qg, kg))
    # adjacent query runs against the same keys, both unmasked: one call
    fused: list[Block] = []
    for c in calls:
        p = fused[-1] if fused else None
        if (p is not None and p.kind == c.kind == "full" and p.q1 == c.q0 and (p.k0, p.k1) == (c.k0, c.k1)):
            fused[-1] = p._replace(q1=c.q1)
        else:
            fused.append(c)
    return fused


def plans(rank: int, world_size: int, n: int, layout: str, is_causal: bool, mod, lead: tuple) -> list:
    """``plan_step`` for every step 0 … P−1 of rank ``rank`` (step s holds the block of rank r − s)."""
    return [plan_step(rank, (rank - s) % world_size, world_size, n, layout, is_causal, mod, lead)
            for s in range(world_size)]


def last_step(step_plans: list) -> int:
    """The last step with anything to compute (−1 when none)."""
    live = [s for s, p in enumerate(step_plans) if p]
    return live[-1] if live else -1


# ---------------------------------------------------------------------------------------------- compute
def forward_block(q, k, v, blk: Block, *, scale: float, enable_gqa: bool, threads=None):
    """One block's partial result with the tiled engine: ``(out (…, q1−q0, Ev), lse (…, q1−q0))``."""
    from qkv.engine.backends import tiled
    out, _, lse = tiled.forward(q[..., blk.q0:blk.q1, :], k[..., blk.k0:blk.k1, :], v[..., blk.k0:blk.k1, :],
                                is_causal=blk.kind == "causal", block_mask=blk.block_mask, scale=scale,
                                enable_gqa=enable_gqa, return_lse=True, threads=threads)
    return out, lse


def backward_block(grad_out, q, k, v, out, lse, blk: Block, *, scale: float, enable_gqa: bool, threads=None):
    """One block's share of the gradients, from the *final* output and log-sum-exp of its query rows
    (FlashAttention-2: ``P = exp(S − lse)``, ``D = rowsum(dO ∘ O)``): ``(dq rows, dk rows, dv rows)``."""
    from qkv.engine.backends import tiled
    rq, rk = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
    return tiled.backward(grad_out[..., rq, :], q[..., rq, :], k[..., rk, :], v[..., rk, :],
                          is_causal=blk.kind == "causal", block_mask=blk.block_mask, scale=scale,
                          enable_gqa=enable_gqa, threads=threads, out=out[..., rq, :], lse=lse[..., rq])
