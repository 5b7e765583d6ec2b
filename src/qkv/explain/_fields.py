"""Validating a worked example's values one key at a time: numbers, matrices, labels, masks, integer lists;
each error names the key (and row) and says expected vs found."""
from __future__ import annotations

import math
import numbers
import re

import numpy as np

from qkv.explain._numbers import Number, WorkedExampleError, _Int, _short, _YamlBool, text_of

_MAX_ELEMENTS = 4_000_000


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _number(x, where: str):
    if isinstance(x, _YamlBool) or isinstance(x, (bool, np.bool_)):
        raise WorkedExampleError(f"{where}: expected a number, found {str(x).lower() if isinstance(x, bool) else x}")
    if not _is_number(x):
        found = "nothing (null)" if x is None else (f"{x!r}" if isinstance(x, str) else type(x).__name__)
        raise WorkedExampleError(f"{where}: expected a number, found {found}")
    if not math.isfinite(float(x)):
        raise WorkedExampleError(f"{where}: expected a finite number, found {_short(text_of(x))}")
    return x


def _matrix(value, key: str, where: str, *, allow_vector: str | None = None) -> np.ndarray:
    """A rectangular matrix of finite numbers → float64 (rows, cols).

    allow_vector: "row" accepts a flat list as one row, "column" as one column.
    """
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a matrix (a list of rows), found "
                                 f"{_describe(value)}")
    if len(value) == 0:
        raise WorkedExampleError(f"{where}: {key}: expected a matrix with at least one row, found an empty list")
    first = value[0] if isinstance(value[0], (list, tuple)) else value
    if len(value) * len(first) > _MAX_ELEMENTS:
        raise WorkedExampleError(f"{where}: {key}: expected at most {_MAX_ELEMENTS} numbers in a worked example, "
                                 f"found {len(value)}×{len(first)}")
    if all(not isinstance(r, (list, tuple)) for r in value) and allow_vector:
        for j, x in enumerate(value):
            _number(x, f"{where}: {key}[{j}]")
        arr = np.array([float(x) for x in value], dtype=np.float64)
        return arr[None, :] if allow_vector == "row" else arr[:, None]
    width = None
    for i, row in enumerate(value):
        if not isinstance(row, (list, tuple)):
            raise WorkedExampleError(f"{where}: {key} row {i}: expected a list of numbers, found {_describe(row)}")
        if width is None:
            width = len(row)
            if width == 0:
                raise WorkedExampleError(f"{where}: {key} row 0: expected at least one number, found an empty row")
        elif len(row) != width:
            raise WorkedExampleError(f"{where}: {key} row {i}: expected {width} numbers (as row 0), found "
                                     f"{len(row)} (ragged matrix)")
        if not all(type(x) in _PLAIN_NUMBERS for x in row):          # the slow check names the first bad one
            for j, x in enumerate(row):
                _number(x, f"{where}: {key}[{i}][{j}]")
    arr = np.array(value, dtype=np.float64)
    if not np.isfinite(arr).all():
        i, j = (int(k) for k in np.argwhere(~np.isfinite(arr))[0])
        _number(value[i][j], f"{where}: {key}[{i}][{j}]")
    return arr


#: Types whose values need no per-element check beyond finiteness (bool and _YamlBool are not among them).
_PLAIN_NUMBERS = frozenset({Number, _Int, float, int})


def _describe(v) -> str:
    if v is None:
        return "nothing (null)"
    if isinstance(v, _YamlBool):
        return f"the boolean {v}"
    if isinstance(v, str):
        return f"the text {v!r}"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)}"
    if _is_number(v):
        return f"the number {_short(text_of(v))}"
    return type(v).__name__


#: Control characters (C0 but tab and newline, DEL, C1): in a label or a title they would reach the terminal as
#: escape sequences (clear the screen, set the window's title); a file's text keeps them visible instead.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """``text`` with its control characters written out as ``\\xHH`` (``\\x1b`` for ESC): shown, never obeyed."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _labels(value, key: str, n: int, what: str, where: str) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a list of {n} labels ({what}), found {_describe(value)}")
    out = []
    for i, t in enumerate(value):
        if t is None or isinstance(t, (dict, list, tuple)):
            raise WorkedExampleError(f"{where}: {key}[{i}]: expected a label (text), found {_describe(t)}")
        out.append(text_of(t) if _is_number(t) and not isinstance(t, bool) else visible(str(t)))
    if len(out) != n:
        raise WorkedExampleError(f"{where}: {key}: expected {n} labels ({what}), found {len(out)}")
    return out


def _flag(x, where: str) -> bool:
    if isinstance(x, _YamlBool):
        return x.value
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if _is_number(x) and float(x) in (0.0, 1.0):
        return bool(float(x))
    raise WorkedExampleError(f"{where}: expected true or false (true = may attend), found {_describe(x)}")


def _mask(value, L: int, S: int, where: str):
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.dtype == np.bool_:
        if value.shape != (L, S):
            raise WorkedExampleError(f"{where}: mask: expected a {L}×{S} boolean matrix (queries × keys), "
                                     f"found shape {value.shape}")
        return value.copy()
    if isinstance(value, str) and not isinstance(value, _YamlBool):
        v = value.strip().lower()
        if v == "causal":
            return "causal"
        if v in ("none", ""):
            return None
        raise WorkedExampleError(f"{where}: mask: expected 'causal', 'none' or a boolean matrix, found {value!r}")
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise WorkedExampleError(f"{where}: mask: expected 'causal' or a {L}×{S} boolean matrix, found "
                                 f"{_describe(value)}")
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, (list, tuple)):
            raise WorkedExampleError(f"{where}: mask row {i}: expected a list of {S} true/false, found {_describe(row)}")
        if len(row) != S:
            raise WorkedExampleError(f"{where}: mask row {i}: expected {S} entries (one per key), found {len(row)}")
        rows.append([_flag(x, f"{where}: mask[{i}][{j}]") for j, x in enumerate(row)])
    if len(rows) != L:
        raise WorkedExampleError(f"{where}: mask: expected {L} rows (one per query), found {len(rows)}")
    return np.array(rows, dtype=bool)


def _scalar(value, key: str, where: str, *, positive: bool = True):
    _number(value, f"{where}: {key}")
    if positive and float(value) <= 0:
        raise WorkedExampleError(f"{where}: {key}: expected a positive number, found {text_of(value)}")
    return value


#: The largest position, document id, window, prefix or sink count a worked example may give (int32's largest:
#: far beyond any example, and every use of it — NumPy's int64 indices, RoPE's float64 angles — exact).
MAX_INDEX = 2**31 - 1


def _nonneg_int(value, key: str, where: str, *, minimum: int = 1) -> int:
    what = "a positive integer" if minimum == 1 else f"an integer ≥ {minimum}"
    if isinstance(value, (_YamlBool, bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
        raise WorkedExampleError(f"{where}: {key}: expected {what}, found {_describe(value)}")
    if value > MAX_INDEX:
        raise WorkedExampleError(f"{where}: {key}: expected {what} of at most {MAX_INDEX:,}, found "
                                 f"{_describe(value)}")
    return int(value)


def _int_list(value, key: str, n: int, what: str, where: str, *, minimum: int = 0) -> np.ndarray:
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a list of {n} integers ({what}), found "
                                 f"{_describe(value)}")
    out = [_nonneg_int(x, f"{key}[{i}]", where, minimum=minimum) for i, x in enumerate(value)]
    if len(out) != n:
        raise WorkedExampleError(f"{where}: {key}: expected {n} integers ({what}), found {len(out)}")
    return np.asarray(out, dtype=np.int64)


def _number_list(value, key: str, n: int, what: str, where: str) -> np.ndarray:
    if _is_number(value) and n == 1:
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a list of {n} numbers ({what}), found {_describe(value)}")
    for i, x in enumerate(value):
        _number(x, f"{where}: {key}[{i}]")
    if len(value) != n:
        raise WorkedExampleError(f"{where}: {key}: expected {n} numbers ({what}), found {len(value)}")
    return np.asarray([float(x) for x in value], dtype=np.float64)


def _lengths_to_ids(value, key: str, S: int, where: str) -> np.ndarray:
    if not isinstance(value, (list, tuple)) or not value:
        raise WorkedExampleError(f"{where}: {key}: expected a list of document lengths summing to {S} (the "
                                 f"sequence), found {_describe(value)}")
    lengths = [_nonneg_int(x, f"{key}[{i}]", where) for i, x in enumerate(value)]
    if sum(lengths) != S:
        raise WorkedExampleError(f"{where}: {key}: expected lengths summing to {S} (the sequence), found "
                                 f"{' + '.join(map(str, lengths))} = {sum(lengths)}")
    return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)

