"""What the model families share: the validation of their text and index arguments (clear errors naming the
argument, expected vs actual)."""
from __future__ import annotations

import numbers
from typing import Iterable

import numpy as np


def texts_arg(texts, name: str = "texts") -> tuple[list[str], bool]:
    """Validate texts: a str (→ one text) or a sequence of non-empty str. Returns (list, was_single)."""
    if isinstance(texts, str):
        items, single = [texts], True
    elif isinstance(texts, (bytes, bytearray, dict)) or not isinstance(texts, Iterable):
        raise TypeError(f"{name}: expected a string or a list of strings, got {type(texts).__name__}")
    else:
        items, single = list(texts), False
    if not items:
        raise ValueError(f"{name}: expected at least one text, got an empty {type(texts).__name__}")
    for i, t in enumerate(items):
        where = name if single else f"{name}[{i}]"
        if not isinstance(t, str):
            raise TypeError(f"{where}: expected a str, got {type(t).__name__} {t!r:.60}")
        if not t.strip():
            raise ValueError(f"{where}: expected a non-empty text, got {t!r} (nothing to tokenize)")
    return items, single


def index_arg(value, name: str, count: int, what: str) -> int:
    """Validate an index into ``count`` ``what`` (layers, heads): an int in 0 … count−1."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer in 0..{count - 1}, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < count:
        raise ValueError(f"{name}: expected an integer in 0..{count - 1} (the model has {count} {what}), "
                         f"got {value}")
    return int(value)
