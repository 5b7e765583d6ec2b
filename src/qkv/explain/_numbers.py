"""Worked-example numbers: the error every unusable file raises, and numbers that keep the text they were
written with (``0.50`` has two decimals), for the files (:mod:`qkv.explain._reading`) and the checker."""
from __future__ import annotations

import math
import numbers
from decimal import Decimal, InvalidOperation


class WorkedExampleError(ValueError):
    """A worked example that cannot be used; the message is one line: where (key, row) and expected vs found."""


# ----------------------------------------------------------------------------------------------- numbers
class Number(float):
    """A float that remembers the text it was written as (``Number(0.5, "0.50").text == "0.50"``)."""

    __slots__ = ("text",)                      # no __dict__: a large file's numbers take a third of the memory
    text: str

    def __new__(cls, value, text: str | None = None):
        obj = super().__new__(cls, value)
        obj.text = text if text is not None else repr(float(value))
        return obj

    def __reduce__(self):
        return (Number, (float(self), self.text))


class _Int(int):
    """An int (from a file) that remembers its text; used for keys and scalars such as ``d_k``."""

    text: str

    def __new__(cls, value, text: str | None = None):
        obj = super().__new__(cls, value)
        obj.text = text if text is not None else str(int(value))
        return obj


class _YamlBool(str):
    """A YAML boolean (``true``, ``no``, ...) kept as its text, so ``no`` stays a usable token label."""

    value: bool

    def __new__(cls, text: str, value: bool):
        obj = super().__new__(cls, text)
        obj.value = value
        return obj


#: Integers written with more digits than this are read as an infinite Number (int() refuses over 4,300
#: digits with a message about sys.set_int_max_str_digits; no such number fits in a float64 anyway).
_MAX_INT_TEXT = 4000


def _int_of(text: str):
    """An integer's text as an _Int; one too long for int() (and for float64) as an infinite Number, so the
    key that holds it is reported ("expected a finite number")."""
    if len(text) > _MAX_INT_TEXT:
        return Number(math.copysign(math.inf, -1.0 if text.lstrip().startswith("-") else 1.0), text)
    return _Int(int(text), text)


def _short(text: str, n: int = 24) -> str:
    """A number's text cut for a message: ``123456789012…(100000 digits)``."""
    text = str(text)
    return text if len(text) <= n else f"{text[:n - 12]}…({len(text)} characters)"


def text_of(x) -> str:
    """The text a number was written as (files), or its shortest repr (numbers given from Python)."""
    t = getattr(x, "text", None)
    if t is not None:
        return t
    if isinstance(x, numbers.Integral):
        return str(int(x))
    return repr(float(x))


def half_unit(x) -> float:
    """Half a unit in the last decimal place of ``x`` as written: ``0.39`` → 0.005, ``0.50`` → 0.005,
    ``1`` → 0.5, ``1.5e-3`` → 0.00005."""
    t = text_of(x).replace("_", "").strip()
    try:
        exp = Decimal(t).as_tuple().exponent
    except (InvalidOperation, ValueError):
        return 0.5
    if not isinstance(exp, int):
        return 0.5
    return 0.5 * 10.0 ** exp
