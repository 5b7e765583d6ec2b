"""Token embeddings and sinusoidal positional encoding: the input of seed 000's path.

    ids → embeddings (vocab lookup) + positions → X, the rows that attention projects into Q, K, V

and rotary position embedding (:func:`rope`, :class:`RoPE`), which rotates each head's Q and K instead.
Shape legend: B batch, H query heads, Hk key/value heads, T sequence length, E width per head.
"""
from __future__ import annotations

import math
import numbers
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from qkv import _checks
from qkv.core import stages


def sinusoidal_positions(seq_len: int, d_model: int, *, base: float = 10000.0, dtype=np.float32) -> np.ndarray:
    """The positional encoding of "Attention Is All You Need" ``(seq_len, d_model)``.

    ``PE[pos, 2i] = sin(pos / base^(2i/d_model))``, ``PE[pos, 2i+1] = cos(pos / base^(2i/d_model))``.
    An odd ``d_model`` ends with a sine column.
    """
    seq_len = _checks.positive_int(seq_len, "seq_len")
    d_model = _checks.positive_int(d_model, "d_model")
    base = _check_theta(base, "base")
    dtype = _checks.float_dtype(dtype, "dtype")
    _checks.fits(8.0 * 3 * seq_len * d_model, "seq_len × d_model")           # float64 angles, sin/cos, table
    pos = np.arange(seq_len, dtype=np.float64)[:, None]                     # (T, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]             # (1, ⌈D/2⌉)
    angle = pos / np.power(base, two_i / d_model)                           # (T, ⌈D/2⌉)
    pe = np.zeros((seq_len, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return pe.astype(dtype)


class TokenEmbedding:
    """A lookup table ``(vocab_size, d_model)``: token id → vector.

    ``weight`` is initialized from N(0, 1) with ``seed`` (as ``torch.nn.Embedding``), or given directly.
    ``embed(ids)`` maps ``(..., T)`` integer ids to ``(..., T, d_model)``; with ``positions=True`` it adds
    :func:`sinusoidal_positions`, which is what seed 000 feeds to W_Q, W_K, W_V.
    """

    def __init__(self, vocab_size: int, d_model: int, *, weight=None, seed=None, dtype=np.float32):
        self.vocab_size = _checks.positive_int(vocab_size, "vocab_size")
        self.d_model = _checks.positive_int(d_model, "d_model")
        dtype = _checks.float_dtype(dtype, "dtype")
        if weight is None:
            _checks.fits(8.0 * vocab_size * d_model, "vocab_size × d_model")
            weight = np.random.default_rng(_checks.seed(seed)).standard_normal((vocab_size, d_model)).astype(dtype)
        else:
            weight = _checks.float_array(weight, "weight", ndim=2)
            if weight.shape != (vocab_size, d_model):
                raise ValueError(f"weight: expected shape ({vocab_size}, {d_model}), got {weight.shape}")
        self.weight = weight

    def embed(self, ids, *, positions: bool = True) -> np.ndarray:
        ids_arr = np.asarray(ids)
        if ids_arr.size == 0:
            raise ValueError(f"ids: expected a non-empty sequence of token ids, got shape {ids_arr.shape}")
        if ids_arr.dtype == np.bool_ or not np.issubdtype(ids_arr.dtype, np.integer):
            raise TypeError(f"ids: expected integer token ids, got dtype {ids_arr.dtype}")
        if ids_arr.ndim == 0 or ids_arr.shape[-1] == 0:
            raise ValueError(f"ids: expected a non-empty sequence of token ids, got shape {ids_arr.shape}")
        if ids_arr.min() < 0 or ids_arr.max() >= self.vocab_size:
            bad = ids_arr[(ids_arr < 0) | (ids_arr >= self.vocab_size)].ravel()[0]
            raise ValueError(f"ids: expected ids in [0, {self.vocab_size}), got {int(bad)}")
        x = self.weight[ids_arr]                                                # (..., T, D)
        stages.observe_input("embeddings", x, "embeddings = E[ids]")
        if positions:
            pe = sinusoidal_positions(ids_arr.shape[-1], self.d_model, dtype=self.weight.dtype)
            x = x + pe                                                          # (..., T, D) + (T, D)
            stages.observe_input("X", x, "X = embeddings + PE")
        return x

    __call__ = embed


# ---------------------------------------------------------------------------------------------- RoPE
ROPE_STYLES = ("neox", "interleaved")


def _check_theta(theta, name: str = "theta") -> float:
    """A frequency base (RoPE's ``theta``, the sinusoids' ``base``): a finite real number > 0."""
    if isinstance(theta, (bool, np.bool_)) or not isinstance(theta, numbers.Real):
        raise TypeError(f"{name}: expected a positive real number, got {type(theta).__name__} {theta!r}")
    if not (math.isfinite(float(theta)) and float(theta) > 0):
        raise ValueError(f"{name}: expected a finite number > 0, got {theta!r}")
    return float(theta)


def _check_style(style) -> str:
    if not isinstance(style, str):
        raise TypeError(f"style: expected one of {ROPE_STYLES}, got {type(style).__name__} {style!r}")
    if style not in ROPE_STYLES:
        raise ValueError(f"style: expected one of {ROPE_STYLES}, got {style!r}")
    return style


def _check_width(E, name: str = "E") -> int:
    E = _checks.positive_int(E, name)
    if E % 2:
        raise ValueError(f"{name}: RoPE rotates pairs of coordinates, expected an even width, got {E}")
    return E


def _check_positions(positions, lead: tuple, T: int) -> np.ndarray:
    """``positions`` as an int64 array ``p_lead + (T,)``, ``p_lead`` a prefix of ``lead`` (each dim equal or 1)."""
    p = np.asarray(positions) if isinstance(positions, (list, tuple, range)) else positions
    if not isinstance(p, (np.ndarray, np.integer, int)) or isinstance(p, (bool, np.bool_)):
        raise TypeError(f"positions: expected an integer numpy array of shape (T,) or (..., T), got "
                        f"{type(positions).__name__}")
    p = np.asarray(p)
    if p.dtype == np.bool_ or not np.issubdtype(p.dtype, np.integer):
        raise TypeError(f"positions: expected integer positions, got dtype {p.dtype}")
    expected = f"(T,) = ({T},) or a prefix of the leading dimensions {lead} followed by T"
    if p.ndim == 0 or p.shape[-1] != T or p.ndim - 1 > len(lead) \
            or any(d not in (1, n) for d, n in zip(p.shape[:-1], lead)):
        raise ValueError(f"positions: expected shape {expected}, got {p.shape}")
    if p.size and p.min() < 0:
        raise ValueError(f"positions: expected non-negative integers, got {int(p.min())}")
    return p.astype(np.int64, copy=False)


def inv_freq(E: int, theta: float = 10000.0) -> np.ndarray:
    """The pair frequencies ``θ_i = theta^(−2i/E)``, i = 0 … E/2 − 1, in float64: (E/2,)."""
    E = _check_width(E)
    theta = _check_theta(theta)
    return 1.0 / theta ** (np.arange(0, E, 2, dtype=np.float64) / E)         # as Hugging Face writes it


class _AngleTables:
    """``cos`` and ``sin`` of ``position × θ_i`` for positions 0 … n−1, float64, one table per (E, theta):
    :func:`cos_sin` looks positions up instead of computing the angles again on every call (a (1, 9, 512, 64)
    query's angles, cos and sin took 0.9 ms of :func:`rope`'s 3 ms; MultiHeadAttention(rope=…) asks twice per
    forward). The values are those computed directly — the same float64 products and ``np.cos``/``np.sin``,
    element by element — so the results do not change (tests check it, bit for bit).

    A table covers the next power of two ≥ the largest position asked for (at least :attr:`MIN_POSITIONS`) and
    grows when a larger position comes; one that would pass :attr:`MAX_BYTES` is not kept (those positions are
    computed directly); at most :attr:`MAX_TABLES` (E, theta) pairs are kept, the least recently used dropped.
    """

    MIN_POSITIONS = 1024
    MAX_BYTES = 16 << 20          # cos and sin together: 16 MiB is 32,768 positions at E = 64
    MAX_TABLES = 8

    def __init__(self):
        self._tables: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0           # tables computed (for tests and curiosity)
        self.hits = 0             # lookups answered by a kept table

    def get(self, E: int, theta: float, n: int):
        """``(cos, sin)`` each (N, E/2) float64 with N ≥ n, or None when such a table is not kept."""
        key = (E, theta)
        with self._lock:
            got = self._tables.get(key)
            if got is not None and got[0].shape[0] >= n:
                self._tables.move_to_end(key)
                self.hits += 1
                return got
        size = max(self.MIN_POSITIONS, 1 << max(0, n - 1).bit_length())
        if size * E * 8 > self.MAX_BYTES:                          # 2 tables × size × E/2 × 8 bytes
            return None
        angles = np.arange(size, dtype=np.float64)[:, None] * inv_freq(E, theta)    # (N, E/2)
        got = (np.cos(angles), np.sin(angles))
        for a in got:
            a.flags.writeable = False                               # shared: handed out as views only
        with self._lock:
            self.builds += 1
            kept = self._tables.get(key)
            if kept is None or kept[0].shape[0] < size:
                self._tables[key] = got
            self._tables.move_to_end(key)
            while len(self._tables) > self.MAX_TABLES:
                self._tables.popitem(last=False)
        return got

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self.builds = self.hits = 0


#: The angle tables of :func:`cos_sin` (shared by every call; thread-safe).
ANGLE_TABLES = _AngleTables()


def cos_sin(positions, E: int, *, theta: float = 10000.0, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of the angles ``position × θ_i``: each ``positions.shape + (E/2,)``, one per pair.

    The angles are computed in float64 and the results cast to ``dtype`` (what a decoder can compute once and
    keep; :func:`qkv.stages.rope` takes them as they are). They come from a table per (E, theta) kept across
    calls (:data:`ANGLE_TABLES`), equal to computing them again.
    """
    E = _check_width(E)
    theta = _check_theta(theta)
    p = np.asarray(positions) if isinstance(positions, (list, tuple, range)) else positions
    if not isinstance(p, np.ndarray) or p.dtype == np.bool_ or not np.issubdtype(p.dtype, np.integer):
        raise TypeError(f"positions: expected an integer numpy array, got "
                        f"{getattr(p, 'dtype', type(p).__name__)}")
    if p.size and p.min() < 0:
        raise ValueError(f"positions: expected non-negative integers, got {int(p.min())}")
    table = ANGLE_TABLES.get(E, theta, int(p.max()) + 1) if p.size else None
    if table is None:
        angles = p.astype(np.float64)[..., None] * inv_freq(E, theta)      # (..., T, E/2)
        return np.cos(angles).astype(dtype, copy=False), np.sin(angles).astype(dtype, copy=False)
    cos, sin = table                                                        # (N, E/2) each
    return cos[p].astype(dtype, copy=False), sin[p].astype(dtype, copy=False)     # (..., T, E/2)


def rope(x, positions=None, *, theta: float = 10000.0, style: str = "neox", name: str = "Q_rot") -> np.ndarray:
    """Rotary position embedding (RoPE): rotate each pair of coordinates of ``x`` by ``position × θ_i``.

    ``θ_i = theta^(−2i/E)``, i = 0 … E/2 − 1. A pair (a, b) at angle φ becomes
    ``(a·cos φ − b·sin φ, b·cos φ + a·sin φ)``, so ``(R_m q)·(R_n k)`` depends only on m − n.

    Args:
        x: (..., T, E) float16/32/64, E even — e.g. one head's queries (B, H, T, E) or keys (B, Hk, T, E).
        positions: integers ≥ 0, shape (T,) (every row the same) or ``lead[:k] + (T,)`` where ``lead`` are x's
            leading dimensions, matched from the left (batch first), each equal or 1: for x (B, H, T, E)
            that is (B, T) as Hugging Face's ``position_ids``, or (B, 1, T), (B, H, T). Default 0 … T − 1.
        theta: the base (10000 in the paper and Llama 2; 500000 in Llama 3), finite and > 0.
        style: ``"neox"`` pairs i with i + E/2 (Hugging Face Llama's ``rotate_half``, GPT-NeoX);
            ``"interleaved"`` pairs 2i with 2i + 1 (GPT-J, Meta's complex form ``x · e^{i·pos·θ}``).
        name: the trace step to record (``"Q_rot"`` or ``"K_rot"``).

    Returns:
        (..., T, E), x's shape and dtype. The angles and their cos/sin are computed in float64 and cast to
        x's dtype for the rotation (Hugging Face forms the angles in float32: at large positions its float32
        angles differ from the exact ones by about position × 6e-8 rad).
    """
    ext = {}
    x = _checks.float_array(x, "x", min_ndim=2, extents=ext)
    big = ext.get("x", 0.0) * math.sqrt(2.0)                        # a rotated pair's coordinate: ≤ √2·max |x|
    if big > float(np.finfo(x.dtype).max):
        raise ValueError(f"x: values up to {ext['x']:.6g} may rotate to {big:.6g}, beyond {x.dtype}'s largest "
                         f"number {float(np.finfo(x.dtype).max):.6g}; use a wider dtype")
    theta = _check_theta(theta)
    style = _check_style(style)
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str (the trace step, e.g. 'Q_rot'), got {type(name).__name__}")
    T, E = x.shape[-2:]
    if E == 0 or E % 2:
        raise ValueError(f"x: RoPE rotates pairs of coordinates, expected an even last dimension E, got {E} "
                         f"(shape {x.shape})")
    lead = x.shape[:-2]
    if positions is None:
        p = np.arange(T, dtype=np.int64)                                        # (T,)
    else:
        p = _check_positions(positions, lead, T)                                 # lead[:k] + (T,)
        p = p.reshape(p.shape[:-1] + (1,) * (len(lead) - (p.ndim - 1)) + (T,))   # broadcastable to lead + (T,)
    cos, sin = cos_sin(p, E, theta=theta)                                       # (..., T, E/2) float64
    return stages.rope(x, cos, sin, style=style, name=name, positions=p, theta=theta)


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding as a module option: ``MultiHeadAttention(..., rope=RoPE())``.

    Args:
        theta: the base of the frequencies ``θ_i = theta^(−2i/E)`` (finite, > 0).
        style: ``"neox"`` (halves, Hugging Face Llama) or ``"interleaved"`` (adjacent pairs, GPT-J / Meta).

    ``rope(x, positions=None, *, name="Q_rot")`` is :func:`qkv.positions.rope` with these settings;
    ``rope.cos_sin(positions, E, dtype)`` the cos/sin a decoder may compute once and keep.
    """

    theta: float = 10000.0
    style: str = "neox"

    def __post_init__(self):
        object.__setattr__(self, "theta", _check_theta(self.theta))
        object.__setattr__(self, "style", _check_style(self.style))

    def __call__(self, x, positions=None, *, name: str = "Q_rot") -> np.ndarray:
        """x (..., T, E), positions (T,) or (..., T)  →  (..., T, E) rotated, recorded as ``name``."""
        return rope(x, positions, theta=self.theta, style=self.style, name=name)

    def cos_sin(self, positions, E: int, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
        """positions (..., T) → cos, sin each (..., T, E/2) in ``dtype``."""
        return cos_sin(positions, E, theta=self.theta, dtype=dtype)
