"""``qkv bench --plan``: the plans of the benchmark's cases (:func:`qkv.plan`), printed instead of timed — why each
case runs as it does (strategy and reason per task, pieces, work fraction), on this machine's kernels and limits."""
from __future__ import annotations

import types

import numpy as np

from qkv.core.blockmask import create_block_mask
from qkv.engine.plans import plan as _plan

#: The variant cases whose plans are shown (the benchmark's own shapes: window 512 and sinks at N = 8192, 8 packed
#: documents of 1024, ALiBi and softcap at 4096, the causal mask mod's backward at 4096).
VARIANT_SIZES = types.MappingProxyType({"window": 8192, "documents": 8192, "mods": 4096, "backward": 4096})


def _inputs(n: int, heads: int, dim: int, batch: int = 1):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((batch, heads, n, dim), dtype=np.float32) for _ in range(3))


def sweep_plans(lengths, modes, heads: int, dim: int, batch: int, threads) -> list:
    """``(title, plan)`` for each N and mode of the timing sweep (forward, causal, backward: the tiled engine's)."""
    out = []
    for n in lengths:
        q, k, v = _inputs(n, heads, dim, batch)
        for mode in modes:
            causal = mode != "forward"
            p = _plan(q, k, v, is_causal=causal, backward=mode == "backward", backend="tiled", threads=threads)
            out.append((f"N = {n}, {mode} (B = {batch}, H = {heads}, E = {dim})", p))
    return out


def variant_plans(cases, heads: int, dim: int, threads) -> list:
    """``(title, plan)`` for each variant case of ``qkv bench --variants`` (as it times them)."""
    from qkv.core import mods
    out = []
    for case in cases:
        n = VARIANT_SIZES[case]
        q, k, v = _inputs(n, heads, dim)
        if case == "window":
            for title, mod in (("sliding window 512", mods.sliding_window(512)),
                               ("4 sinks or window 512", mods.or_masks(mods.sinks(4), mods.sliding_window(512))),
                               (f"prefix LM {n // 8}", mods.prefix_lm(n // 8))):
                bm = create_block_mask(mod, None, None, n, n)
                out.append((f"{title}, N = {n}", _plan(q, k, v, block_mask=bm, backend="tiled", threads=threads)))
        elif case == "documents":
            bm = create_block_mask(mods.document_from_lengths([1024] * 8), None, None, n, n)
            out.append((f"8 packed documents of 1024, N = {n}",
                        _plan(q, k, v, block_mask=bm, backend="tiled", threads=threads)))
        elif case == "mods":
            for title, mod in (("ALiBi", mods.alibi(mods.alibi_slopes(heads))), ("softcap 50", mods.softcap(50.0))):
                out.append((f"causal {title}, N = {n}", _plan(q, k, v, is_causal=True, score_mod=mod,
                                                                 backend="tiled", threads=threads)))
        else:
            bm = create_block_mask(mods.causal(), None, None, n, n)
            out.append((f"causal mask mod, backward, N = {n}",
                        _plan(q, k, v, block_mask=bm, backward=True, backend="tiled", threads=threads)))
    return out


def render(plans: list, limit: int = 12) -> str:
    """The plans as text, each under its title (the first ``limit`` tasks of each)."""
    from qkv.engine.backends.tiled.plan_text import render as _render
    blocks = []
    for title, p in plans:
        blocks.append(f"== {title} ==\n{_render(p, limit=limit)}")
    return "\n\n".join(blocks)

