"""Mask builders. Every mask here is a boolean array, **True where attention is allowed**.

That is the convention of ``torch.nn.functional.scaled_dot_product_attention`` and of this whole package.
(``torch.nn.MultiheadAttention``'s ``key_padding_mask`` and boolean ``attn_mask`` mean the opposite, True =
blocked; convert them with ``~mask`` once, at the boundary.) Float masks are a separate case: they are
added to the scaled scores (0 keeps, ``-inf`` removes, anything else biases).

Causal alignment when L ≠ S (L = 3 queries, S = 5 keys, ``1`` = may attend)::

    top-left (torch is_causal)      bottom-right (decoding with a cache)
        k0 k1 k2 k3 k4                  k0 k1 k2 k3 k4
    q0   1  0  0  0  0              q0   1  1  1  0  0
    q1   1  1  0  0  0              q1   1  1  1  1  0
    q2   1  1  1  0  0              q2   1  1  1  1  1

Bottom-right treats the L queries as the *last* L positions of the S keys, which is what a decoder with a
KV cache needs: the new tokens see the whole cache and each other causally.
"""
from __future__ import annotations

import numpy as np

from qkv import _checks

_ALIGNS = ("top-left", "bottom-right")


def _lengths(q_len, k_len):
    q_len = _checks.positive_int(q_len, "q_len")
    k_len = q_len if k_len is None else _checks.positive_int(k_len, "k_len")
    return q_len, k_len


def _offset(q_len: int, k_len: int, align: str) -> int:
    if align not in _ALIGNS:
        raise ValueError(f"align: expected one of {_ALIGNS}, got {align!r}")
    return 0 if align == "top-left" else k_len - q_len


def causal(q_len: int, k_len: int | None = None, *, align: str = "top-left") -> np.ndarray:
    """Causal mask ``(L, S)``: query i may attend to key j when ``j ≤ i + offset``.

    ``align="top-left"`` (offset 0) matches torch's ``is_causal=True``; ``"bottom-right"`` (offset S − L)
    is for decoding with a cache. Bottom-right with L > S leaves the first L − S query rows fully masked
    (they return zeros).
    """
    q_len, k_len = _lengths(q_len, k_len)
    off = _offset(q_len, k_len, align)
    _checks.fits(float(q_len) * k_len, "q_len × k_len")            # the (L, S) bools
    i = np.arange(q_len)[:, None]                                  # (L, 1)
    j = np.arange(k_len)[None, :]                                  # (1, S)
    return j <= i + off                                            # (L, S)


def sliding_window(q_len: int, k_len: int | None = None, *, window: int, causal: bool = True,
                   align: str = "top-left") -> np.ndarray:
    """Local attention ``(L, S)``: query i sees the keys within ``window`` positions of it (itself included).

    With ``causal=True`` key j is allowed when ``0 ≤ i' − j < window``; otherwise when ``|i' − j| < window``,
    where ``i' = i + offset`` is the query's position on the key axis (see :func:`causal` for ``align``).
    ``window=1`` lets each query see only its own position.
    """
    q_len, k_len = _lengths(q_len, k_len)
    window = _checks.positive_int(window, "window")
    _checks.boolean(causal, "causal")
    off = _offset(q_len, k_len, align)
    _checks.fits(10.0 * q_len * k_len, "q_len × k_len")                  # int64 distances and the bools
    d = (np.arange(q_len)[:, None] + off) - np.arange(k_len)[None, :]   # (L, S) distance query − key
    if causal:
        return (d >= 0) & (d < window)
    return np.abs(d) < window


def padding(lengths=None, max_len: int | None = None, *, is_real=None) -> np.ndarray:
    """Key padding mask ``(B, 1, 1, S)``, True at real tokens, broadcastable over heads and queries.

    Give either ``lengths`` (the number of real tokens of each sequence, padding at the end) with an
    optional ``max_len`` (default ``max(lengths)``), or ``is_real``: a boolean ``(B, S)`` array that is True
    at real tokens.
    """
    if (lengths is None) == (is_real is None):
        raise ValueError("padding: expected exactly one of lengths= or is_real=, got "
                         + ("both" if lengths is not None else "neither"))
    if is_real is not None:
        is_real = np.asarray(is_real)
        if is_real.dtype != np.bool_:
            raise TypeError(f"is_real: expected a bool array (True = real token), got dtype {is_real.dtype}")
        if is_real.ndim != 2:
            raise ValueError(f"is_real: expected shape (batch, S), got {is_real.shape}")
        return is_real[:, None, None, :]
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"lengths: expected a 1-D sequence of integers, got shape {lengths.shape} "
                        f"dtype {lengths.dtype}")
    if lengths.size == 0:
        raise ValueError("lengths: expected at least one sequence, got none")
    if np.any(lengths < 0):
        raise ValueError(f"lengths: expected non-negative lengths, got {lengths.tolist()}")
    longest = int(lengths.max())
    S = longest if max_len is None else _checks.positive_int(max_len, "max_len")
    if longest > S:
        raise ValueError(f"lengths: expected every length <= max_len={S}, got {longest}")
    real = np.arange(S)[None, :] < lengths[:, None]                 # (B, S)
    return real[:, None, None, :]                                   # (B, 1, 1, S)


def combine(*masks) -> np.ndarray | None:
    """Combine boolean masks: attention is allowed where **every** mask allows it (logical AND).

    ``None`` entries are skipped; shapes broadcast (e.g. a causal ``(L, S)`` with a padding
    ``(B, 1, 1, S)`` gives ``(B, 1, L, S)``). Returns None when every argument is None.
    """
    out = None
    for n, m in enumerate(masks):
        if m is None:
            continue
        m = np.asarray(m)
        if m.dtype != np.bool_:
            raise TypeError(f"masks[{n}]: expected a bool mask (True = may attend), got dtype {m.dtype}; "
                            "turn a float mask into an additive bias instead of combining it")
        if out is None:
            out = m
        else:
            try:
                out = out & m
            except ValueError:
                raise ValueError(f"masks[{n}]: shape {m.shape} does not broadcast with {out.shape}") from None
    return out


def to_additive(mask: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A boolean mask (True = may attend) as an additive float mask: 0 where allowed, ``-inf`` elsewhere."""
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"mask: expected a bool mask (True = may attend), got dtype {mask.dtype}")
    return np.where(mask, 0.0, -np.inf).astype(_checks.float_dtype(dtype, "dtype"))   # −inf needs a float
