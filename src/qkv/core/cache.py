"""KVCache: the keys and values of the tokens seen so far, for decoding one (or a few) tokens at a time.

A decoder that generates token t needs the keys and values of tokens 0..t. Recomputing them every step costs
O(t) projections per step; the cache keeps them and each step appends only the new tokens'. The queries of
the new tokens are the *last* positions of the keys, so the causal mask is aligned bottom-right
(:func:`qkv.masks.causal` with ``align="bottom-right"``)::

    step with 2 new tokens after 3 cached (L = 2, S = 5; 1 = may attend)
        k0 k1 k2 k3 k4
    q3   1  1  1  1  0
    q4   1  1  1  1  1

Use it through :meth:`qkv.MultiHeadAttention.forward` (``cache=``) or directly with :meth:`KVCache.append`.

Positions: :attr:`KVCache.offset` is the position of the next token (the number of tokens appended so far).
A module with RoPE rotates the new tokens at ``offset + 0 … L−1`` and stores the keys already rotated, so
cached decoding equals the full causal forward.
"""
from __future__ import annotations

import numpy as np

from qkv import _checks


class KVCache:
    """Keys (B, Hk, S, E) and values (B, Hk, S, Ev) of the tokens so far, grown by :meth:`append`.

    Storage grows geometrically (amortized O(1) copy per token); :attr:`keys`/:attr:`values` are views of
    the filled part. The first append fixes batch, heads, widths and dtype; later ones must match.
    """

    def __init__(self):
        self._k: np.ndarray | None = None
        self._v: np.ndarray | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def keys(self) -> np.ndarray | None:
        """(B, Hk, S, E) keys so far, or None before the first append."""
        return None if self._k is None else self._k[:, :, :self._len]

    @property
    def values(self) -> np.ndarray | None:
        """(B, Hk, S, Ev) values so far, or None before the first append."""
        return None if self._v is None else self._v[:, :, :self._len]

    @property
    def offset(self) -> int:
        """The position of the next token: the number of tokens appended so far (``len(cache)``).

        :meth:`qkv.MultiHeadAttention.forward` with RoPE places the new tokens at ``offset + 0 … L−1``.
        """
        return self._len

    def reset(self) -> None:
        """Forget every token (a new sequence); :attr:`offset` returns to 0."""
        self._k = self._v = None
        self._len = 0

    def append(self, key, value) -> tuple[np.ndarray, np.ndarray]:
        """Append the new tokens' keys (B, Hk, T, E) and values (B, Hk, T, Ev); return all (B, Hk, S, ·)."""
        key = _checks.float_array(key, "key", ndim=4)
        value = _checks.float_array(value, "value", ndim=4)
        k_new, v_new = self.reserve(key.shape, value.shape, key.dtype, value.dtype)
        k_new[...] = key
        v_new[...] = value
        return self.keys, self.values

    def reserve(self, key_shape: tuple, value_shape: tuple, dtype, value_dtype=None) -> tuple[np.ndarray, np.ndarray]:
        """Room for T new tokens: the cache's views (B, Hk, T, E) and (B, Hk, T, Ev) where their keys and values
        go, for the caller to fill before anything reads the cache; :attr:`offset` moves past them now. (A
        decoder's prefill: its row-wise workers write the rows each made, where :meth:`append` copies them all
        on one thread.) ``dtype`` the keys', ``value_dtype`` the values' (default: the same); the same checks
        as :meth:`append`."""
        value_dtype = dtype if value_dtype is None else value_dtype
        key_shape, value_shape = tuple(key_shape), tuple(value_shape)
        if len(key_shape) != 4 or len(value_shape) != 4:
            raise ValueError(f"key/value: expected 4 dimensions (B, Hk, T, ·), got key {key_shape}, value "
                             f"{value_shape}")
        if key_shape[:3] != value_shape[:3]:
            raise ValueError(f"value: expected batch, heads and length {key_shape[:3]} (as key), got "
                             f"{value_shape[:3]}")
        if np.dtype(dtype) != np.dtype(value_dtype):
            raise TypeError(f"value: expected dtype {np.dtype(dtype)} (as key), got {np.dtype(value_dtype)}")
        B, H, T, E = key_shape
        Ev = value_shape[-1]
        if self._k is None:
            cap = max(16, T)
            self._k = np.empty((B, H, cap, E), dtype)
            self._v = np.empty((B, H, cap, Ev), dtype)
        else:
            self._check_like(key_shape, value_shape, dtype)
            if self._len + T > self._k.shape[2]:
                cap = max(2 * self._k.shape[2], self._len + T)
                for name in ("_k", "_v"):
                    old = getattr(self, name)
                    new = np.empty(old.shape[:2] + (cap,) + old.shape[3:], old.dtype)
                    new[:, :, :self._len] = old[:, :, :self._len]
                    setattr(self, name, new)
        got = self._k[:, :, self._len:self._len + T], self._v[:, :, self._len:self._len + T]
        self._len += T
        return got

    def _check_like(self, key_shape: tuple, value_shape: tuple, dtype) -> None:
        """New tokens must match the cached ones' batch, heads, widths and dtype."""
        B, H, _, E = key_shape
        b, h, _, e = self._k.shape
        if (B, H, E, value_shape[-1]) != (b, h, e, self._v.shape[-1]):
            raise ValueError(f"key/value: expected (B, Hk, ·, E) = ({b}, {h}, ·, {e}) and Ev = "
                             f"{self._v.shape[-1]} as the cached tokens, got key {key_shape}, value "
                             f"{value_shape}")
        if np.dtype(dtype) != self._k.dtype:
            raise TypeError(f"key: expected dtype {self._k.dtype} (as the cached tokens), got {np.dtype(dtype)}")

    def __repr__(self) -> str:
        shape = None if self._k is None else self.keys.shape
        return f"KVCache(length={self._len}, keys={shape})"
