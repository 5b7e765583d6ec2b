"""Attention of new tokens' queries over a :class:`qkv.KVCache`, reading a float16 or int8 cache as stored.

:func:`cache_attention` is a decoder's attention after it appended the new tokens' keys and values: the L
queries are the last L of the cache's S positions (causal, bottom-right), every key and value head shared by
H / Hk query heads (grouped-query attention). For a quantized cache (``KVCache(dtype=np.float16 | np.int8)``)
and a few queries (L ≤ :data:`DECODE_MAX_ROWS`: decoding) it runs the compiled kernel
(:func:`qkv.compute.kv_decode.decode`), which reads each stored key and value once and never makes the float32
copy; the cache's bytes per token are a half (float16) or 17/64 (int8) of float32's. Otherwise — no numba,
the kernels set to ``"numpy"``, a long query block (a prompt after a cached prefix), or a float cache — the
cache's keys and values (dequantized copies when quantized) go through
:func:`qkv.scaled_dot_product_attention`.
"""
from __future__ import annotations

import math

import numpy as np

from qkv import _checks
from qkv.compute import kv_decode
from qkv.core import kv_quant as _kv_quant, masks
from qkv.core.cache import KVCache
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.sdpa import scaled_dot_product_attention

__all__ = ["DECODE_MAX_ROWS", "PARALLEL_MIN", "cache_attention"]

#: The most queries a call hands the compiled kernel (more: the dequantized cache through the engine, whose
#: matrix products pay for the float32 copy).
DECODE_MAX_ROWS = 16
#: The fewest stored numbers (B·Hk·S·(E + Ev)) a call reads before its tasks go to more than one of numba's
#: threads (the runtime's count, :func:`qkv.set_num_threads`). Measured with SmolLM2's 3 key/value heads at
#: 4,096 tokens (1.6 M numbers, 0.5 ms a call on one thread): two threads gained nothing on the 2-core test
#: machine, and where BLAS ran multi-threaded around the steps they made each step 2–3× slower (OpenMP's
#: idle threads spin while BLAS's want the cores).
PARALLEL_MIN = 1 << 22


def cache_attention(query, cache: KVCache, *, scale: float | None = None) -> np.ndarray:
    """softmax(q·kᵀ·scale, causal bottom-right)·v of ``query`` (B, H, L, E) over every token of ``cache``
    (B, Hk, S, E / Ev, S ≥ L, H a multiple of Hk); ``scale`` default 1/√E. Returns (B, H, L, Ev), float32 from
    the compiled kernel, else the dtype the engine returns for the query's.

    The kernel (quantized cache, L ≤ :data:`DECODE_MAX_ROWS`, numba): float32 throughout, the softmax's max
    subtracted, within float32 summation error of float64 attention over the dequantized cache
    (tests/unit/test_kv_quant.py)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a qkv.KVCache, got {type(cache).__name__}")
    q = _checks.float_array(query, "query", ndim=4)
    S = len(cache)
    keys, values, key_scales, value_scales = cache.storage()
    if keys is None:
        raise ValueError("cache: expected at least one token, got an empty cache")
    B, H, L, E = q.shape
    if (B, E) != (keys.shape[0], keys.shape[3]) or H % keys.shape[1] or L > S:
        raise ValueError(f"query: expected (B, H, L, E) with B = {keys.shape[0]}, H a multiple of "
                         f"{keys.shape[1]}, L ≤ {S} and E = {keys.shape[3]} (the cache's), got {q.shape}")
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    if cache.quantized and L <= DECODE_MAX_ROWS and kv_decode.available():
        work = B * keys.shape[1] * S * (E + values.shape[3])
        threads = 1 if RUNTIME.in_worker() or work < PARALLEL_MIN else RUNTIME.get_num_threads()
        return kv_decode.decode(q, keys, values, key_scales, value_scales, S, scale, threads, _kv_quant.BLOCK)
    k, v = cache.keys, cache.values                                    # (B, Hk, S, ·), copies when quantized
    mask = None if L == 1 else masks.causal(L, S, align="bottom-right")
    return scaled_dot_product_attention(q, k.astype(q.dtype, copy=False), v.astype(q.dtype, copy=False),
                                        attn_mask=mask, scale=scale, enable_gqa=H != k.shape[1])
