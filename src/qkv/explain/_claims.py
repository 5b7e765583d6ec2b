"""Validating a worked example's ``claims:``: the numbers someone claims for the later steps, by row."""
from __future__ import annotations

import numbers
import re
from typing import TYPE_CHECKING

from qkv.explain._fields import _describe, _is_number, _number
from qkv.explain._numbers import Number, WorkedExampleError, _YamlBool, text_of
from qkv.explain._worked import CLAIM_NAMES, KEY_SIDE

if TYPE_CHECKING:
    from qkv.explain._worked import Worked


def _row_index(key, labels: list[str], given: bool, n: int, where: str) -> int:
    """A claim's row key: a label of the rows, else a 0-based index."""
    if isinstance(key, _YamlBool):
        key_text = str(key)
    elif _is_number(key):
        key_text = text_of(key)
    else:
        key_text = str(key)
    if given:
        hits = [i for i, t in enumerate(labels) if t == key_text]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise WorkedExampleError(f"{where}: row {key_text!r}: the label appears {len(hits)} times "
                                     f"(rows {hits}); use the 0-based row index instead")
    idx = None
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        idx = int(key)
    elif isinstance(key, str) and re.fullmatch(r"\d+", key_text):
        idx = int(key_text)
    if idx is None:
        known = labels if given else []
        hint = f"one of {known} or a row index 0..{n - 1}" if known else f"a row index 0..{n - 1} (no labels given)"
        raise WorkedExampleError(f"{where}: row {key_text!r}: no such label; expected {hint}")
    if not 0 <= idx < n:
        raise WorkedExampleError(f"{where}: row {idx}: expected a row index 0..{n - 1}")
    return idx


def _claim_row(values, width: int, where: str) -> list:
    if _is_number(values) or isinstance(values, _YamlBool):
        if width != 1:
            raise WorkedExampleError(f"{where}: expected a list of {width} numbers, found a single number")
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise WorkedExampleError(f"{where}: expected a list of {width} numbers, found {_describe(values)}")
    if len(values) != width:
        raise WorkedExampleError(f"{where}: expected {width} numbers, found {len(values)}")
    out = []
    for j, x in enumerate(values):
        if x is None:
            out.append(None)                                    # null: not claimed
            continue
        _number(x, f"{where}[{j}]")
        out.append(x if isinstance(x, Number) else Number(float(x), text_of(x)))
    return out


def _claims(value, w: Worked, shapes: dict[str, tuple[int, int]], where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WorkedExampleError(f"{where}: claims: expected a mapping of step names ({', '.join(CLAIM_NAMES)}) "
                                 f"to rows, found {_describe(value)}")
    out: dict[str, dict[int, list]] = {}
    for name, rows in value.items():
        name = str(name)
        if name not in CLAIM_NAMES:
            raise WorkedExampleError(f"{where}: claims: unknown name {name!r}; expected one of "
                                     f"{', '.join(CLAIM_NAMES)}")
        if name not in shapes:
            raise WorkedExampleError(f"{where}: claims.{name}: this example does not compute {name} "
                                     f"({_why_missing(name, w)})")
        L, C = shapes[name]
        key_side = name in KEY_SIDE
        labels = w.key_labels if key_side else list(w.tokens)
        given = (w.kv_tokens_given if (key_side and w.kv_tokens is not None) else w.tokens_given)
        at = f"{where}: claims.{name}"
        parsed: dict[int, list] = {}
        if isinstance(rows, dict):
            for key, vals in rows.items():
                i = _row_index(key, labels, given, L, at)
                label = labels[i]
                parsed[i] = _claim_row(vals, C, f"{at}[{label if given else i}]")
        elif isinstance(rows, (list, tuple)) and rows and all(isinstance(r, (list, tuple)) for r in rows):
            if len(rows) != L:
                raise WorkedExampleError(f"{at}: expected {L} rows (the whole matrix), found {len(rows)}; give "
                                         "a subset as a mapping {label or row index: [...]}")
            for i, vals in enumerate(rows):
                parsed[i] = _claim_row(vals, C, f"{at}[{i}]")
        elif isinstance(rows, (list, tuple)) and rows and L == 1:
            parsed[0] = _claim_row(rows, C, f"{at}[0]")
        elif isinstance(rows, (list, tuple)) and rows and C == 1:
            if len(rows) != L:
                raise WorkedExampleError(f"{at}: expected {L} numbers (one column), found {len(rows)}")
            for i, x in enumerate(rows):
                parsed[i] = _claim_row([x], 1, f"{at}[{i}]")
        elif _is_number(rows) and L == 1 and C == 1:
            parsed[0] = _claim_row([rows], 1, f"{at}")
        else:
            raise WorkedExampleError(f"{at}: expected a {L}×{C} matrix or a mapping {{label or row index: "
                                     f"[{C} numbers]}}, found {_describe(rows)}")
        out[name] = parsed
    return out


def _why_missing(name: str, w: Worked) -> str:
    if name in ("Q_rot", "K_rot") and w.rope is None:
        return "it has no rope:"
    if name == "biased" and w.alibi is None:
        return "it has no alibi:"
    if name == "capped" and w.softcap is None:
        return "it has no softcap:"
    if w.heads > 1:
        return f"per-head {name} claims are not supported with heads > 1; claim Q, K or V"
    if name in ("Q", "K") and w.start == "scores":
        return "it starts from scores"
    if name == "V" or name == "output":
        return "it gives no V"
    return "not part of this example"
