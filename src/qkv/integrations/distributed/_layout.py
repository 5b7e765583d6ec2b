"""How a sequence is split among the ranks of a ring: ``"contiguous"`` and ``"zigzag"`` (NumPy only).

``contiguous``: rank r holds positions r·n … (r+1)·n − 1 (n = N/P). Under a causal mask rank 0's queries see
one block and rank P−1's see all P, so the last rank works P times as long as the first.

``zigzag`` (ring-flash-attention, PyTorch's context parallel "load balancing"): the sequence is cut into
2·P chunks of c = N/(2P) positions and rank r holds chunks r and 2P−1−r, one from each end::

    N = 16, P = 2: chunks  0 1 2 3          rank 0: chunks 0, 3   positions 0–3, 12–15
                          r0 r1 r1 r0        rank 1: chunks 1, 2   positions 4–11

so every rank does the same causal work: at each ring step a rank either computes its whole query shard
against the first half of the arriving block, or the second half of its queries against the whole block.
"""
from __future__ import annotations

import numbers

import numpy as np

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout, name: str = "layout") -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{name}: expected one of {', '.join(repr(x) for x in LAYOUTS)}, got {layout!r}")
    return layout


def _int(x, name: str, minimum: int) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__} {x!r}")
    if int(x) < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {x}")
    return int(x)


def units(world_size: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into: P (contiguous) or 2·P (zigzag)."""
    return world_size if layout == "contiguous" else 2 * world_size


def length_error(N: int, world_size: int, layout: str) -> str | None:
    """Why a sequence of N positions cannot be split among ``world_size`` ranks in ``layout`` (None if it can)."""
    k = units(world_size, layout)
    if N % k == 0:
        return None
    up = -(-N // k) * k
    what = (f"layout='zigzag' cuts the sequence into 2·P = {k} equal chunks (rank r takes chunks r and 2P−1−r)"
            if layout == "zigzag" else f"layout='contiguous' gives each of the P = {k} ranks an equal slice")
    hint = f"pad it to {up} (under a causal mask, padding at the end changes no earlier output) and drop the padding"
    if layout == "zigzag" and N % world_size == 0:
        hint += ", or use layout='contiguous'"
    return f"{what}, so the length must be a multiple of {k}; got N = {N}: {hint}"


def chunk_of(rank: int, world_size: int, layout: str) -> list[int]:
    """The chunk indices (in units of N / units(P, layout)) rank ``rank`` holds, in local order."""
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def segments(rank: int, world_size: int, n: int, layout: str) -> list[tuple[int, int, int]]:
    """Rank ``rank``'s local rows as ``(local_start, local_end, global_start)`` runs (n rows per rank)."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2
    return [(0, c, rank * c), (c, n, (2 * world_size - 1 - rank) * c)]


def positions(rank: int, world_size: int, n: int, layout: str) -> np.ndarray:
    """The global position of each of rank ``rank``'s n local rows."""
    return np.concatenate([np.arange(g, g + b - a) for a, b, g in segments(rank, world_size, n, layout)])


def _seq_axis(x: np.ndarray, seq_dim, name: str) -> int:
    ok = not isinstance(seq_dim, (bool, np.bool_)) and isinstance(seq_dim, numbers.Integral)
    if not ok or not -x.ndim <= int(seq_dim) < x.ndim:
        raise ValueError(f"seq_dim: expected an axis of the {x.ndim}-dimensional {name} "
                         f"(−{x.ndim} … {x.ndim - 1}), got {seq_dim!r}")
    return int(seq_dim) % x.ndim


def shard(x, rank, world_size, *, layout="zigzag", seq_dim=-2):
    """Rank ``rank``'s share of the sequence ``x`` (NumPy; no torch needed).

    Args:
        x: an array with the sequence along ``seq_dim`` (query, key, value (..., H, N, E): seq_dim=-2).
        rank: 0 … world_size − 1.
        world_size: P, the number of ranks.
        layout: ``"zigzag"`` (default: 2·P chunks, rank r gets chunks r and 2P−1−r — balanced causal work) or
            ``"contiguous"`` (rank r gets the r-th of P equal slices).
        seq_dim: the sequence axis.

    Returns:
        (..., N/P, ...): a view for ``"contiguous"``, a new array for ``"zigzag"``.

    Raises:
        ValueError when N is not a multiple of P (contiguous) or 2·P (zigzag), naming what to do.
    """
    P = _int(world_size, "world_size", 1)
    r = _int(rank, "rank", 0)
    if r >= P:
        raise ValueError(f"rank: expected 0 … world_size − 1 = {P - 1}, got {r}")
    layout = check_layout(layout)
    arr = np.asarray(x)
    if arr.ndim == 0:
        raise ValueError("x: expected an array with a sequence axis, got a scalar")
    ax = _seq_axis(arr, seq_dim, "x")
    N = arr.shape[ax]
    err = length_error(N, P, layout)
    if err:
        raise ValueError(f"shard: {err}")
    k = units(P, layout)
    c = N // k
    idx = [slice(None)] * arr.ndim
    parts = []
    for u in chunk_of(r, P, layout):
        idx[ax] = slice(u * c, (u + 1) * c)
        parts.append(arr[tuple(idx)])
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=ax)


def unshard(parts, *, layout="zigzag", seq_dim=-2):
    """The whole sequence from every rank's share (``parts[r]`` = rank r's), the inverse of :func:`shard`.

    Raises:
        ValueError for shares of different shapes, or (zigzag) of odd length.
    """
    if isinstance(parts, np.ndarray) or not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(f"parts: expected a non-empty list of every rank's array (rank order), got "
                        f"{type(parts).__name__}")
    layout = check_layout(layout)
    arrs = [np.asarray(p) for p in parts]
    P = len(arrs)
    if arrs[0].ndim == 0:
        raise ValueError("parts: expected arrays with a sequence axis, got scalars")
    ax = _seq_axis(arrs[0], seq_dim, "part")
    for r, a in enumerate(arrs):
        if a.shape != arrs[0].shape:
            raise ValueError(f"parts: every rank's share must have the same shape; rank 0 has {arrs[0].shape}, "
                             f"rank {r} has {a.shape}")
    n = arrs[0].shape[ax]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"parts: layout='zigzag' shares hold two equal chunks, so their length must be even; "
                         f"got {n}")
    k = units(P, layout)
    c = (n * P) // k
    chunks: list = [None] * k
    idx = [slice(None)] * arrs[0].ndim
    for r, a in enumerate(arrs):
        for j, u in enumerate(chunk_of(r, P, layout)):
            idx[ax] = slice(j * c, (j + 1) * c)
            chunks[u] = a[tuple(idx)]
    return np.concatenate(chunks, axis=ax)
