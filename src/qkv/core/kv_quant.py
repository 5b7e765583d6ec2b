"""The storage formats of a :class:`qkv.KVCache` made with ``dtype=np.float16`` or ``np.int8``.

float16: the rows cast to float16 (round to nearest even; relative error ≤ 2⁻¹¹ = 4.9e-4 in float16's
normal range, |x| ≥ 6.1e-5; absolute ≤ 2⁻²⁵ = 3.0e-8 below it). Numbers beyond float16's range
(|x| > 65504) are a ValueError, not ±inf.

int8: llama.cpp's ``q8_0`` layout (ggml's ``block_q8_0``): each row of E numbers in blocks of :data:`BLOCK` = 32
(the last one shorter where 32 does not divide E), one float16 scale per block::

    d = max|x| / 127 over the block, as a float16 rounded up      q = round(x / d) ∈ [−127, 127] (int8)
    x̂ = q · d                                                      (a block of zeros: d = 0, q = 0)

34 bytes per 32 numbers (E = 64: 64 + 2·2 = 68 bytes a row). Rounding d *up* to float16 (ggml rounds it to
nearest and quantizes with the unrounded d) keeps |x / d| ≤ 127, so |x − x̂| ≤ d / 2 for every element with d
the stored scale, tiny blocks (d below float16's subnormals) included. A block with max|x| > 127 · 65504 is a
ValueError. Why blocks of 32 and not one float32 scale per row (the same 1.0625 bytes a number at E = 64, and
one scale per dot product in the kernel): measured on SmolLM2-135M over 2,048 tokens of text, blocks of 32 have
22 % (keys) and 13 % (values) less RMS error on its keys and values (every layer), and half the KL divergence
of its next-token distribution from the float32 cache's (3.3e-4 nats, against 6.6e-4 with one float16 scale
per row); the kernel converts a stored row into float32 once, scales included, either way. Rounding the scale
up instead of to nearest changes neither measurably (benchmarks/ACCURACY.md, "The KV cache in float16 and int8").
"""
from __future__ import annotations

import numpy as np

#: The storage dtypes a KVCache may be asked for (besides None: the appended rows' own dtype).
DTYPES = (np.dtype(np.float16), np.dtype(np.int8))
#: The largest finite float16.
F16_MAX = float(np.finfo(np.float16).max)
#: The int8 codes' range: ±127 (−128 unused, as q8_0).
Q_MAX = 127
#: Numbers per int8 scale (q8_0's QK8_0).
BLOCK = 32


def check_dtype(dtype, name: str = "dtype") -> np.dtype | None:
    """``dtype`` as None, float16 or int8: a TypeError naming ``name`` where it is no dtype, a ValueError where
    it is another one (expected vs actual)."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected None, numpy.float16 or numpy.int8, got {dtype!r}") from None
    if dt not in DTYPES:
        raise ValueError(f"{name}: expected None, numpy.float16 or numpy.int8, got {dt}")
    return dt


def blocks(width: int) -> int:
    """The int8 scales a row of ``width`` numbers has: ⌈width / 32⌉."""
    return -(-width // BLOCK)


def store(x: np.ndarray, out: np.ndarray, scales: np.ndarray | None, name: str) -> None:
    """Rows x (…, E) float into the storage ``out`` (…, E) (float16 or int8) and, for int8, their scales
    ``scales`` (…, ⌈E/32⌉) float16. Numbers that are not finite, or beyond the storage's range, are a ValueError
    naming ``name``; nothing is written then."""
    if out.dtype == np.float16:
        m = float(np.max(np.abs(x))) if x.size else 0.0
        if not m <= F16_MAX:                                     # NaN fails too
            raise ValueError(f"{name}: expected finite values within float16's range (|x| ≤ {F16_MAX:g}) for a "
                             f"float16 cache, got max |x| = {m:g}")
        out[...] = x
        return
    E = x.shape[-1]
    nb = blocks(E)
    xb = np.zeros(x.shape[:-1] + (nb * BLOCK,), np.result_type(x.dtype, np.float32))
    xb[..., :E] = x
    xb = xb.reshape(x.shape[:-1] + (nb, BLOCK))                  # (…, nb, 32), the last block zero-padded
    d = np.max(np.abs(xb), axis=-1) / np.float32(Q_MAX)          # (…, nb)
    if not np.all(d <= F16_MAX):                                 # NaN and inf fail too
        bad = d[~(d <= F16_MAX)][0] * Q_MAX
        raise ValueError(f"{name}: expected finite values with max |x| ≤ {Q_MAX * F16_MAX:g} per block of "
                         f"{BLOCK} for an int8 cache, got {bad:g}")
    d16 = d.astype(np.float16)
    low = d16.astype(d.dtype) < d                                # rounded down: one float16 step up
    d16[low] = np.nextafter(d16[low], np.float16(np.inf))
    d = d16.astype(xb.dtype)[..., None]
    q = np.divide(xb, d, out=np.zeros_like(xb), where=d > 0)
    np.rint(q, out=q)
    np.clip(q, -Q_MAX, Q_MAX, out=q)
    out[...] = q.reshape(xb.shape[:-2] + (nb * BLOCK,))[..., :E]
    scales[...] = d16


def load(stored: np.ndarray, scales: np.ndarray | None, dtype) -> np.ndarray:
    """The float rows (…, E) of ``dtype`` that storage ``stored`` (…, E) holds (``scales`` (…, ⌈E/32⌉) for
    int8): a new array, ``q · d`` in float32 (exact) then cast."""
    if stored.dtype == np.float16:
        return stored.astype(dtype)
    E = stored.shape[-1]
    nb = scales.shape[-1]
    out = np.zeros(stored.shape[:-1] + (nb * BLOCK,), np.float32)
    out[..., :E] = stored
    out = out.reshape(stored.shape[:-1] + (nb, BLOCK))
    out *= scales.astype(np.float32)[..., None]
    out = out.reshape(stored.shape[:-1] + (nb * BLOCK,))[..., :E]
    return out.astype(dtype)
