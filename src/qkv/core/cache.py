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

Storage: ``KVCache(dtype=np.float16)`` or ``KVCache(dtype=np.int8)`` keeps the keys and values in 2 or 1
byte(s) a number (int8 in llama.cpp's q8_0 layout, a float16 scale per block of 32: :mod:`qkv.core.kv_quant`
says how, and what it costs in accuracy), where a decoder reads the whole cache for every new token. :attr:`KVCache.keys` and
:attr:`KVCache.values` are then float copies (dequantized); :meth:`KVCache.storage` gives the stored
arrays themselves, which a decode kernel reads directly (:func:`qkv.engine.kv_attention.cache_attention`).
"""
from __future__ import annotations

import numpy as np

from qkv import _checks
from qkv.core import kv_quant as _kv_quant


class KVCache:
    """Keys (B, Hk, S, E) and values (B, Hk, S, Ev) of the tokens so far, grown by :meth:`append`.

    ``dtype``: None (the default) stores the appended arrays' own dtype; ``np.float16`` or ``np.int8`` stores
    them in that format (:mod:`qkv.core.kv_quant`), converted as they are appended. Storage grows
    geometrically (amortized O(1) copy per token). The first append fixes batch, heads, widths and the float
    dtype; later ones must match. Without ``dtype``, :attr:`keys`/:attr:`values` are views of the filled
    part; with one, float copies (dequantized) in the appended arrays' dtype.
    """

    def __init__(self, dtype=None):
        self._stored = _kv_quant.check_dtype(dtype)    # None, float16 or int8
        self.reset()

    def __len__(self) -> int:
        return self._len

    @property
    def dtype(self) -> np.dtype | None:
        """The storage dtype asked for: None (the appended arrays' own), float16 or int8."""
        return self._stored

    @property
    def row_dtype(self) -> np.dtype | None:
        """The float dtype of the rows appended (fixed by the first append), None before it."""
        return self._float

    @property
    def quantized(self) -> bool:
        """Whether the keys and values are stored as float16 or int8 (``dtype`` given)."""
        return self._stored is not None

    @property
    def keys(self) -> np.ndarray | None:
        """(B, Hk, S, E) keys so far, or None before the first append (a float copy when :attr:`quantized`)."""
        return self._filled(self._k, self._ks)

    @property
    def values(self) -> np.ndarray | None:
        """(B, Hk, S, Ev) values so far, or None before the first append (a float copy when :attr:`quantized`)."""
        return self._filled(self._v, self._vs)

    def _filled(self, stored, scales) -> np.ndarray | None:
        if stored is None:
            return None
        if self._stored is None:
            return stored[:, :, :self._len]
        self._flush()
        n = self._len
        return _kv_quant.load(stored[:, :, :n], None if scales is None else scales[:, :, :n], self._float)

    def storage(self) -> tuple:
        """``(keys, values, key_scales, value_scales)``: the stored arrays themselves, for kernels — keys
        (B, Hk, C, E) and values (B, Hk, C, Ev) in the storage dtype, C ≥ ``len(self)`` the capacity (positions
        ``len(self)`` … C−1 are unfilled); for int8 the scales (B, Hk, C, ⌈E/32⌉) and (B, Hk, C, ⌈Ev/32⌉)
        float16 (``x̂ = q · d`` per block of 32 numbers of a row, :mod:`qkv.core.kv_quant`), else None. All None
        before the first append. C-contiguous; read them before the next append."""
        self._flush()
        return self._k, self._v, self._ks, self._vs

    def nbytes_per_token(self) -> int:
        """The bytes one position takes (keys, values and scales, every batch row and head); 0 before the
        first append."""
        if self._k is None:
            return 0
        per = self._k.shape[0] * self._k.shape[1]
        scales = 0 if self._ks is None else 2 * per * (self._ks.shape[3] + self._vs.shape[3])
        return per * (self._k.shape[3] + self._v.shape[3]) * self._k.itemsize + scales

    @property
    def offset(self) -> int:
        """The position of the next token: the number of tokens appended so far (``len(cache)``).

        :meth:`qkv.MultiHeadAttention.forward` with RoPE places the new tokens at ``offset + 0 … L−1``.
        """
        return self._len

    def reset(self) -> None:
        """Forget every token (a new sequence); :attr:`offset` returns to 0."""
        self._k = self._v = None
        self._ks = self._vs = None                     # int8's scales (B, Hk, C, ⌈E/32⌉) float16
        self._float = None                             # the appended arrays' dtype
        self._pending: list = []                       # reserve()'d float rows not yet stored: (t0, k, v)
        self._len = 0

    def append(self, key, value) -> tuple[np.ndarray, np.ndarray]:
        """Append the new tokens' keys (B, Hk, T, E) and values (B, Hk, T, Ev); return all (B, Hk, S, ·)
        (:attr:`keys`, :attr:`values`: copies when :attr:`quantized`)."""
        key = _checks.float_array(key, "key", ndim=4)
        value = _checks.float_array(value, "value", ndim=4)
        if self._stored is None:
            k_new, v_new = self.reserve(key.shape, value.shape, key.dtype, value.dtype)
            k_new[...] = key
            v_new[...] = value
        else:
            t0 = self._grow(key.shape, value.shape, key.dtype, value.dtype)
            self._put(t0, key, value)
        return self.keys, self.values

    def reserve(self, key_shape: tuple, value_shape: tuple, dtype, value_dtype=None) -> tuple[np.ndarray, np.ndarray]:
        """Room for T new tokens: the cache's views (B, Hk, T, E) and (B, Hk, T, Ev) where their keys and values
        go, for the caller to fill before anything reads the cache; :attr:`offset` moves past them now. (A
        decoder's prefill: its row-wise workers write the rows each made, where :meth:`append` copies them all
        on one thread.) ``dtype`` the keys', ``value_dtype`` the values' (default: the same); the same checks
        as :meth:`append`. When :attr:`quantized`: new float arrays of ``dtype`` instead of views, converted
        into the storage when the cache is next read or grown (any property, :meth:`storage`, an append)."""
        t0 = self._grow(key_shape, value_shape, dtype, value_dtype)
        T = self._len - t0
        if self._stored is None:
            return self._k[:, :, t0:self._len], self._v[:, :, t0:self._len]
        B, H, _, E = self._k.shape
        got = np.empty((B, H, T, E), self._float), np.empty((B, H, T, self._v.shape[3]), self._float)
        self._pending.append((t0,) + got)
        return got

    def reserve_stored(self, key_shape: tuple, value_shape: tuple, dtype) -> tuple:
        """Room for T new tokens, for a kernel that writes them in the storage format itself (a compiled
        decoding step): :meth:`storage`'s arrays, with :attr:`offset` moved past the T positions it must fill
        before anything reads the cache. The same checks as :meth:`append`; :meth:`truncate` takes them back."""
        self._grow(key_shape, value_shape, dtype)
        return self._k, self._v, self._ks, self._vs

    def truncate(self, length: int) -> None:
        """Forget the tokens from position ``length`` on (0 ≤ length ≤ :attr:`offset`): :attr:`offset` becomes
        ``length``; the storage is kept."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise TypeError(f"length: expected an int, got {type(length).__name__}")
        if not 0 <= length <= self._len:
            raise ValueError(f"length: expected 0 … {self._len} (the cached tokens), got {length}")
        self._pending = [p for p in self._pending if p[0] < length]
        if self._pending and self._pending[-1][0] + self._pending[-1][1].shape[2] > length:
            t0, k, v = self._pending.pop()
            self._pending.append((t0, k[:, :, :length - t0], v[:, :, :length - t0]))
        self._len = int(length)

    def _grow(self, key_shape: tuple, value_shape: tuple, dtype, value_dtype=None) -> int:
        """Check T new tokens' shapes and dtype, make room for them and move :attr:`offset` past them; returns
        the first one's position."""
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
        self._flush()
        B, H, T, E = key_shape
        if self._k is None:
            self._float = np.dtype(dtype)
            self._alloc((B, H, max(16, T)), E, value_shape[-1])
        else:
            self._check_like(key_shape, value_shape, dtype)
            if self._len + T > self._k.shape[2]:
                self._resize(max(2 * self._k.shape[2], self._len + T))
        t0 = self._len
        self._len += T
        return t0

    def _alloc(self, bhc: tuple, E: int, Ev: int) -> None:
        """Empty storage of capacity ``bhc`` = (B, Hk, C): keys, values and (int8) their scales."""
        stored = self._float if self._stored is None else self._stored
        self._k, self._v = np.empty(bhc + (E,), stored), np.empty(bhc + (Ev,), stored)
        if self._stored == np.int8:
            self._ks = np.empty(bhc + (_kv_quant.blocks(E),), np.float16)
            self._vs = np.empty(bhc + (_kv_quant.blocks(Ev),), np.float16)

    def _resize(self, cap: int) -> None:
        """Storage of capacity ``cap`` holding the filled positions."""
        for name in ("_k", "_v", "_ks", "_vs"):
            old = getattr(self, name)
            if old is not None:
                new = np.empty(old.shape[:2] + (cap,) + old.shape[3:], old.dtype)
                new[:, :, :self._len] = old[:, :, :self._len]
                setattr(self, name, new)

    def _put(self, t0: int, key: np.ndarray, value: np.ndarray) -> None:
        """Float rows key (B, Hk, T, E), value (B, Hk, T, Ev) into the storage at positions t0 … t0+T−1."""
        t1 = t0 + key.shape[2]
        sk = None if self._ks is None else self._ks[:, :, t0:t1]
        sv = None if self._vs is None else self._vs[:, :, t0:t1]
        try:
            _kv_quant.store(key, self._k[:, :, t0:t1], sk, "key")
            _kv_quant.store(value, self._v[:, :, t0:t1], sv, "value")
        except ValueError:
            self._len, self._pending = t0, []              # these rows (the last ones) are not in the cache
            raise

    def _flush(self) -> None:
        """Store the rows :meth:`reserve` handed out (quantized caches), oldest first."""
        while self._pending:
            t0, k, v = self._pending.pop(0)
            self._put(t0, k, v)

    def _check_like(self, key_shape: tuple, value_shape: tuple, dtype) -> None:
        """New tokens must match the cached ones' batch, heads, widths and dtype."""
        B, H, _, E = key_shape
        b, h, _, e = self._k.shape
        if (B, H, E, value_shape[-1]) != (b, h, e, self._v.shape[-1]):
            raise ValueError(f"key/value: expected (B, Hk, ·, E) = ({b}, {h}, ·, {e}) and Ev = "
                             f"{self._v.shape[-1]} as the cached tokens, got key {key_shape}, value "
                             f"{value_shape}")
        if np.dtype(dtype) != self._float:
            raise TypeError(f"key: expected dtype {self._float} (as the cached tokens), got {np.dtype(dtype)}")

    def __repr__(self) -> str:
        shape = None if self._k is None else self._k.shape[:2] + (self._len,) + self._k.shape[3:]
        stored = "" if self._stored is None else f", dtype={self._stored}"
        return f"KVCache(length={self._len}, keys={shape}{stored})"
