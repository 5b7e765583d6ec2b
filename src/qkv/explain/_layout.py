"""What the explainer shows of a step: its labels, its 2-D slices, its rows (row-sampled steps) and its tables.

The sizes the document switches at (:data:`SMALL`, :data:`EDGE`, ...), the argument checks shared by
:func:`qkv.explain.render.render` and :func:`qkv.explain.render.explain_query`, and the elided tables.
"""
from __future__ import annotations

import numpy as np

from qkv.core.tracing import Step, Trace
from qkv.explain import doc as _doc
from qkv.explain.doc import Table, fmt
from qkv.locales import check_lang, t

#: rows/columns shown in full; larger matrices show the first EDGE and the last EDGE ("…" between) and a summary
SMALL = 8
EDGE = 3
SHOW = 6
#: a matrix product's element is written out term by term when the inner dimension is at most this
MAX_TERMS = 8
#: every element's arithmetic is written out when a slice has at most this many elements
MAX_CALC = 36
#: (batch, head) slices shown one by one; more show the first and say so
MAX_SLICES = 4

QUERY_SIDE = frozenset(
    {"X", "Q", "Q_heads", "Q_rot", "scores", "scaled", "biased", "capped", "modified", "masked", "weights",
     "dropout", "output", "concat", "final_output"})
KEY_SIDE = frozenset({"X_kv", "K", "V", "K_heads", "V_heads", "K_repeated", "V_repeated", "K_rot"})
PER_HEAD = frozenset({"Q_heads", "K_heads", "V_heads", "K_repeated", "V_repeated", "Q_rot", "K_rot", "scores", "scaled",
            "biased", "capped", "modified", "masked", "weights", "dropout", "output"})
KEYS_AS_COLS = frozenset({"scores", "scaled", "biased", "capped", "modified", "masked", "weights", "dropout"})


# ----------------------------------------------------------------------------------------------- checks
def _check_common(trace, lang, fmt_name, precision, tokens, kv_tokens):
    if not isinstance(trace, Trace):
        raise TypeError(f"trace: expected a qkv.Trace, got {type(trace).__name__}")
    if len(trace) == 0:
        raise ValueError("trace: expected a trace with recorded steps, got an empty one (run something with "
                         "trace= or inside qkv.trace())")
    check_lang(lang)
    if fmt_name not in _doc.FORMATS:
        raise ValueError(f"fmt: expected one of {', '.join(_doc.FORMATS)}, got {fmt_name!r}")
    if isinstance(precision, bool) or not isinstance(precision, (int, np.integer)) or not 0 <= precision <= 12:
        raise ValueError(f"precision: expected an integer 0..12, got {precision!r}")
    for name, labels in (("tokens", tokens), ("kv_tokens", kv_tokens)):
        if labels is not None and (isinstance(labels, str) or not all(isinstance(x, str) for x in labels)):
            raise TypeError(f"{name}: expected a list of str or None, got {labels!r}")
    return None if tokens is None else list(tokens), None if kv_tokens is None else list(kv_tokens)


class _Labels:
    """Row/column labels for query and key rows, from tokens/kv_tokens (indices when absent)."""

    def __init__(self, trace: Trace, tokens, kv_tokens):
        L, S = _lengths(trace)
        if tokens is not None and L is not None and len(tokens) != L:
            raise ValueError(f"tokens: expected {L} labels (one per query row), got {len(tokens)}")
        if kv_tokens is not None and S is not None and len(kv_tokens) != S:
            raise ValueError(f"kv_tokens: expected {S} labels (one per key row), got {len(kv_tokens)}")
        self.q = tokens
        if kv_tokens is not None:
            self.k = kv_tokens
        elif tokens is not None and "X_kv" not in trace and (S is None or S == len(tokens)):
            self.k = tokens
        else:
            self.k = None

    def query(self, i: int) -> str:
        return self.q[i] if self.q is not None and i < len(self.q) else str(i)

    def key(self, j: int) -> str:
        return self.k[j] if self.k is not None and j < len(self.k) else str(j)

    def rows(self, name: str, n: int) -> list[str]:
        if name in KEY_SIDE:
            return [self.key(j) for j in range(n)]
        if name in QUERY_SIDE:
            return [self.query(i) for i in range(n)]
        return [str(i) for i in range(n)]

    def cols(self, name: str, n: int) -> list[str]:
        if name in KEYS_AS_COLS:
            return [self.key(j) for j in range(n)]
        return [str(j) for j in range(n)]


def _lengths(trace: Trace):
    for name in ("weights", "scores", "scaled"):
        if name in trace:
            shape = full_shape(trace[name])
            return shape[-2], shape[-1]
    L = trace["X"].array.shape[-2] if "X" in trace else None
    S = trace["X_kv"].array.shape[-2] if "X_kv" in trace else L
    return L, S


# ----------------------------------------------------------------------------------------------- slicing
def _per_head(step: Step, trace: Trace) -> bool:
    if step.name in PER_HEAD:
        return True
    if step.name in ("Q", "K", "V") and "Q_heads" not in trace and step.op == "input":
        return True                                    # SDPA called directly on (..., H, L, E)
    return False


def _slices(step: Step, trace: Trace, lang: str):
    """(label, lead index) for every 2-D slice of the step's array."""
    lead = step.array.shape[:-2]
    per_head = _per_head(step, trace)
    out = []
    for idx in np.ndindex(*lead) if lead else [()]:
        parts = []
        for k, v in enumerate(idx):
            if per_head and k == len(idx) - 1:
                parts.append(t("explain.head", lang, h=v))
            elif lead[k] > 1:                          # a batch of one is not worth a label
                parts.append(t("explain.batch", lang, b=v))
        out.append((" · ".join(parts), idx))
    return out


def _shape(a) -> str:
    return "(" + ", ".join(str(d) for d in np.shape(a)) + ")"


# ----------------------------------------------------------------------------------------------- row-sampled steps
def held_rows(step: Step) -> np.ndarray | None:
    """The true query rows a row-sampled step holds (along axis −2), or None when it holds them all."""
    rows = step.params.get("rows") if isinstance(step.params, dict) else None
    return None if rows is None else np.asarray(rows)


def full_shape(step: Step) -> tuple:
    """The shape of the whole array (a row-sampled step's array holds only some of its rows)."""
    return tuple(step.params.get("full_shape") or np.shape(step.array))


def _dims(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _step_shape(step: Step) -> str:
    """The step's shape as the document writes it: the whole array's, also for a row-sampled step."""
    return _dims(full_shape(step))


def _operand_shape(step: Step, key: str) -> str:
    """An operand's shape; a row-indexed operand of a row-sampled step with all its rows counted."""
    a = step.operands.get(key)
    if a is None:
        return "?"
    shape = tuple(np.shape(a))
    if held_rows(step) is not None and key in step.params.get("row_operands", ()):
        shape = shape[:-2] + (full_shape(step)[-2],) + shape[-1:]
    return _dims(shape)


def _true_row(step: Step, i: int) -> int:
    rows = held_rows(step)
    return int(i) if rows is None else int(rows[i])


def _local_row(step: Step, row: int) -> int:
    """Where true query row ``row`` is in the step's array (ValueError when a row-sampled step lacks it)."""
    rows = held_rows(step)
    if rows is None:
        return int(row)
    hit = np.flatnonzero(rows == row)
    if not hit.size:
        raise ValueError(f"row: the trace's {step.name} holds only rows {rows.tolist()} (a row-sampled trace of a "
                         f"large input); expected one of them, got {row}")
    return int(hit[0])


def _edges(n: int) -> list[int]:
    """The indices shown of n: all when n ≤ SMALL, else the first EDGE and the last EDGE."""
    if n <= SMALL:
        return list(range(n))
    return list(range(EDGE)) + list(range(n - EDGE, n))


def shown_rows(step: Step) -> list[int]:
    """Local indices (into the step's array) of the rows a table shows, in order."""
    rows = held_rows(step)
    n = full_shape(step)[-2]
    if rows is None:
        return _edges(n)
    want = set(_edges(n))
    return [k for k, i in enumerate(rows.tolist()) if i in want]


def stats(mat: np.ndarray) -> tuple[int, float, float, float] | None:
    """(count, min, max, mean of the finite values) of an array, None when none is finite."""
    a = np.asarray(mat, dtype=np.float64)
    finite = a[np.isfinite(a)]
    if not finite.size:
        return None
    return a.size, float(finite.min()), float(finite.max()), float(finite.sum() / finite.size)


def _table(name: str, mat: np.ndarray, rows: list[str], cols: list[str], lang: str, precision: int,
           kind: str = "num", *, row_ids=None, n_rows: int | None = None, summary=None, dtype=None) -> Table:
    """A table of ``mat``; beyond SMALL rows or columns, the first EDGE and last EDGE of them with "…" between.

    ``mat`` holds every row, or (a row-sampled step) the rows ``row_ids`` of ``n_rows``; ``rows`` labels the
    rows held. ``summary``: (count, min, max, mean) of the whole array (default: computed from ``mat``).
    """
    mat = np.asarray(mat)
    R_held, C = mat.shape
    ids = list(range(R_held)) if row_ids is None else [int(i) for i in row_ids]
    R = R_held if n_rows is None else int(n_rows)
    dtype = None if dtype is None else str(dtype)
    if R <= SMALL and C <= SMALL and R_held == R:
        return Table(name, rows, cols, mat.tolist(), kind, dtype=dtype)
    want = set(_edges(R))
    show_r = [k for k, i in enumerate(ids) if i in want]
    show_c = _edges(C)
    vals, rl = [], []
    prev = None
    for k in show_r:
        if prev is not None and ids[k] != ids[prev] + 1:
            vals.append([None] * (len(show_c) + (1 if C > SMALL else 0)))
            rl.append("…")
        row = [mat[k, j].item() for j in show_c]
        if C > SMALL:
            row.insert(EDGE, None)
        vals.append(row)
        rl.append(rows[k])
        prev = k
    cl = [cols[j] for j in show_c]
    if C > SMALL:
        cl.insert(EDGE, "…")
    parts = []
    if R > SMALL:
        parts.append(t("explain.elided_rows", lang, k=EDGE, n=R))
    if C > SMALL:
        parts.append(t("explain.elided_cols", lang, k=EDGE, m=C))
    if kind == "num":
        st = summary if summary is not None else stats(mat)
        if st is not None:
            parts.append(t("explain.summary", lang, n=st[0], min=fmt(st[1], precision), max=fmt(st[2], precision),
                           mean=fmt(st[3], precision)))
    return Table(name, rl, cl, vals, kind, "; ".join(parts) if parts else None, dtype=dtype)


def _limited_slices(step, trace, lang):
    sl = _slices(step, trace, lang)
    if len(sl) <= MAX_SLICES:
        return sl, None
    shown = sl[0][0]
    return sl[:1], t("explain.slices_more", lang, shown=shown, rest=len(sl) - 1)
