"""Validation at the public boundary.

Every public function validates its arguments here, once, and raises ``TypeError`` (wrong kind of thing)
or ``ValueError`` (right kind, wrong value) with a message that names the argument and shows what was
expected and what was found. Nothing here uses ``assert``.
"""
from __future__ import annotations

import numbers

import numpy as np

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        return f"array of shape {x.shape} and dtype {x.dtype}"
    return type(x).__name__


def float_array(x, name: str, *, min_ndim: int = 0, ndim: int | None = None, finite: bool = True) -> np.ndarray:
    """Return ``x`` as a floating NumPy array or raise a clear error.

    Lists of numbers are accepted and become float64; integer/bool arrays are rejected (attention is
    defined on real numbers, and torch rejects them too).
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (list, tuple)) or isinstance(x, numbers.Number):
        try:
            arr = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}: expected a numeric array, got a {type(x).__name__} that is "
                            f"not a rectangular array of numbers ({exc})") from None
    else:
        raise TypeError(f"{name}: expected a numpy.ndarray, got {_describe(x)}")
    if arr.dtype.type not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float16, float32 or float64, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {arr.ndim} (shape {arr.shape})")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got {arr.ndim} (shape {arr.shape})")
    if finite and not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"{name}: expected finite numbers, got {arr[tuple(bad)]} at index {tuple(int(i) for i in bad)}")
    return arr


def positive_int(x, name: str, *, minimum: int = 1) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral,)):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__} {x!r}")
    if int(x) < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {x}")
    return int(x)


def boolean(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def mask_array(mask, name: str) -> np.ndarray:
    """A mask is boolean (True = may attend) or floating (added to the scaled scores)."""
    if not isinstance(mask, np.ndarray):
        if isinstance(mask, (list, tuple)):
            mask = np.asarray(mask)
        else:
            raise TypeError(f"{name}: expected a numpy.ndarray of bool (True = may attend) or float "
                            f"(added to the scores), got {_describe(mask)}")
    if mask.dtype == np.bool_:
        return mask
    if mask.dtype.type in FLOAT_DTYPES:
        if np.any(np.isnan(mask)) or np.any(mask == np.inf):
            raise ValueError(f"{name}: a float mask may hold finite numbers and -inf, got NaN or +inf")
        return mask
    raise TypeError(f"{name}: expected dtype bool (True = may attend) or a float dtype (added to the "
                    f"scores), got {mask.dtype}")


def broadcastable(shape, target, name: str, target_desc: str) -> None:
    try:
        out = np.broadcast_shapes(tuple(shape), tuple(target))
    except ValueError:
        raise ValueError(f"{name}: shape {tuple(shape)} does not broadcast to {target_desc} "
                         f"{tuple(target)}") from None
    if out != tuple(target):
        raise ValueError(f"{name}: shape {tuple(shape)} would broadcast {target_desc} {tuple(target)} "
                         f"up to {out}; expected a shape that broadcasts to {tuple(target)}")
