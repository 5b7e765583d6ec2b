"""The compiled decode kernel over a float16 or int8 KV cache (:mod:`qkv.compute._jit_kv`), from NumPy arrays.

:func:`decode` runs it where numba is installed and the engine's kernels are not set to ``"numpy"``
(:mod:`qkv.compute.kernels`); :func:`available` says whether it will. :func:`qkv.engine.kv_attention.cache_attention`
calls it for a decoding step, and dequantizes the cache into the ordinary attention otherwise.

Threads: the kernel's tasks (one per batch row, key/value head and run of keys: :func:`parts`) run on numba's own threads, at most
``threads`` of them (numba's ``set_num_threads``, for this call). Calls are serialized by a lock: numba's
``workqueue`` threading layer — the one it falls back to without TBB or OpenMP — aborts the process when two
threads launch parallel kernels at once.
"""
from __future__ import annotations

import threading
from types import MappingProxyType

import numpy as np

from qkv.compute.kernels import KERNELS

__all__ = ["PART_KEYS", "STORAGES", "available", "decode", "kernel_args", "parts", "step_kernels"]

#: Keys per run of a head's keys, at least (:func:`parts`): each run is a task of its own, merged by maxima.
PART_KEYS = 256
#: A cache's storage dtype → its kernels' name (:func:`step_kernels`).
STORAGES = MappingProxyType({np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.int8): "int8"})

_LOCK = threading.Lock()


def available() -> bool:
    """Whether :func:`decode` can run here: numba installed, the kernels' choice not ``"numpy"`` (loads them)."""
    return KERNELS.choice != "numpy" and KERNELS.jit() is not None


def parts(length: int) -> int:
    """Runs of keys per (batch row, key/value head) for ``length`` keys: one per :data:`PART_KEYS`, 1 … 16
    (so that a model's few key/value heads, SmolLM2's 3, still keep every thread busy at long contexts)."""
    return max(1, min(16, int(length) // PART_KEYS))


def step_kernels(storage: str) -> tuple:
    """For a compiled decoding step (numba code calling numba code) over a cache stored as ``storage``
    (``"f32"``, ``"f16"`` or ``"int8"``): ``(decode, store)`` — the attention kernel :func:`decode` runs, and
    the function that writes a new float32 row into a storage row as :meth:`qkv.KVCache.append` would
    (``store(src (E,), dst (E,), scales (⌈E/32⌉,), 32) -> bool``, False where the format cannot hold it)."""
    from qkv.compute import _jit_kv
    return {"f32": (_jit_kv.decode_f32, _jit_kv.store_f32), "f16": (_jit_kv.decode_f16, _jit_kv.store_f16),
            "int8": (_jit_kv.decode_int8, _jit_kv.store_int8)}[storage]


def kernel_args(keys: np.ndarray, values: np.ndarray, key_scales, value_scales) -> tuple:
    """A cache's storage (:meth:`qkv.KVCache.storage`) as the kernels read it: ``(name, keys, values, key
    scales, value scales)``, ``name`` the kernels' (:data:`STORAGES`; any other dtype runs the float32 loop),
    float16 as its bits (uint16), int8's float16 scales too, and for float32 and float16 a zero-stride
    placeholder (B, Hk, C) for the scales, which their kernels do not read."""
    name = STORAGES.get(keys.dtype, "f32")
    if name == "f16":
        keys, values = keys.view(np.uint16), values.view(np.uint16)
    if key_scales is None:
        key_scales = value_scales = np.broadcast_to(np.float32(1.0), keys.shape[:3])
    else:
        key_scales, value_scales = key_scales.view(np.uint16), value_scales.view(np.uint16)
    return name, keys, values, key_scales, value_scales


def decode(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_scales, value_scales, length: int,
           scale: float, threads: int = 1, block: int = 32) -> np.ndarray:
    """The attention (B, H, L, Ev) float32 of q (B, H, L, E) over the first ``length`` positions of a cache's
    storage (:meth:`qkv.KVCache.storage`): keys (B, Hk, C, E) and values (B, Hk, C, Ev) C-contiguous, float16
    or int8 (or float32: the same loop, for comparisons), for int8 the scales (B, Hk, C, ⌈E/block⌉) and
    (B, Hk, C, ⌈Ev/block⌉) float16 (else None), one per ``block`` numbers of a row;
    causal bottom-right (the L queries are the last L of the ``length`` keys), scores times ``scale``, H a
    multiple of Hk (query heads h·g … h·g + g − 1 read key/value head h). ``threads``: at most this many of
    numba's threads. Needs numba (:func:`available`)."""
    from numba import config, get_num_threads, set_num_threads

    B, H, L, _ = q.shape
    qs = np.empty(q.shape, np.float32)
    np.multiply(q, np.float32(scale), out=qs, casting="unsafe")      # (B, H, L, E) scaled, contiguous
    out = np.empty((B, H, L, values.shape[3]), np.float32)
    name, k, v, ks, vs = kernel_args(keys, values, key_scales, value_scales)
    kernel = step_kernels(name)[0]
    n = max(1, min(int(threads), config.NUMBA_NUM_THREADS, B * keys.shape[1] * parts(length)))
    with _LOCK:
        before = get_num_threads()
        set_num_threads(n)
        try:
            kernel(qs, k, v, ks, vs, int(length), out, int(block), parts(length))
        finally:
            set_num_threads(before)
    return out
