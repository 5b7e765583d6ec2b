"""Render a :class:`qkv.Trace` as the textbook hand calculation (text, markdown, JSON; English or Chinese).

Nothing here computes attention. Every number shown after an ``=`` is an element of a stage's own recorded
output; the arithmetic to its left is formatted from the operands that stage recorded (``Step.terms`` for
the matrix products; ``exp``, ``sum`` and ``max`` recorded by :func:`qkv.stages.softmax`). Large inputs switch
to shapes, tables with elided middles (the first and last rows and columns, "…" between) and summaries, and
write out one element's arithmetic.

Row-sampled steps. A step whose ``params`` hold ``rows`` (the true query rows its array keeps, along axis −2),
``full_shape`` and ``stats`` (count, min, max, mean over the whole array) was recorded by
:func:`qkv.explain.examples.run_rows`: an (L, S) step of a large input kept only at the rows the explainer shows.
Its row-indexed operands (``row_operands``) are kept at the same rows. The document says the same as for the
whole array (shapes, summaries, the elided table); only the rows it shows are held in memory.
"""
from __future__ import annotations

import math

import numpy as np

from ..tracing import Step, Trace
from . import _doc
from . import _variants as var
from ._doc import Doc, Section, Table, fit, fmt, fmt_factor, shown
from ..locales import check_lang, t

__all__ = ["render", "explain_query", "build_doc", "build_query_doc"]

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

QUERY_SIDE = {"X", "Q", "Q_heads", "Q_rot", "scores", "scaled", "biased", "capped", "modified", "masked", "weights",
              "dropout", "output", "concat", "final_output"}
KEY_SIDE = {"X_kv", "K", "V", "K_heads", "V_heads", "K_repeated", "V_repeated", "K_rot"}
PER_HEAD = {"Q_heads", "K_heads", "V_heads", "K_repeated", "V_repeated", "Q_rot", "K_rot", "scores", "scaled",
            "biased", "capped", "modified", "masked", "weights", "dropout", "output"}
KEYS_AS_COLS = {"scores", "scaled", "biased", "capped", "modified", "masked", "weights", "dropout"}


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


#: The steps that may come between the scaling and the softmax, last first: the softmax reads the last present.
_BEFORE_SOFTMAX = ("masked", "modified", "capped", "biased", "scaled")


def softmax_formula(step: Step, trace: Trace) -> str:
    """The softmax step's formula naming what it was applied to: ``softmax(masked)`` after a mask (the stage
    records ``softmax(scaled)`` whatever came before it)."""
    formula = step.formula or ""
    names = trace.names()
    before = names[:names.index(step.name)] if step.name in names else names
    src = next((n for n in _BEFORE_SOFTMAX if n in before), None)
    if src is not None and "softmax(scaled)" in formula:
        formula = formula.replace("softmax(scaled)", f"softmax({src})")
    return formula


def _dk(d_k) -> str:
    d = float(d_k)
    return str(int(d)) if d.is_integer() else repr(d)


def _product_line(lhs: str, terms, value, precision: int, bias=None, lang: str = "en") -> str:
    """``lhs = a×b + c×d + … = value``: written with enough decimals that it adds up (else ``≈``; see
    :func:`qkv.explain._doc.fit`). Beyond MAX_TERMS terms the first three and a count (not a sum to check)."""
    if len(terms) > MAX_TERMS:
        head = " + ".join(f"{fmt_factor(a, precision)}×{fmt_factor(b, precision)}" for a, b in terms[:3])
        expr = f"{head} + {t('explain.terms_more', lang, n=len(terms))}"
        if bias is not None:
            expr += f" + {fmt_factor(bias, precision)}"
        return f"{lhs} = {expr} = {fmt(value, precision)}"

    def build(ln) -> str:
        pairs = [(ln.f(a), ln.f(b)) for a, b in terms]
        expr = " + ".join(f"{x}×{y}" for x, y in pairs)
        vals = [(shown(x), shown(y)) for x, y in pairs]
        exact = None if any(x is None or y is None for x, y in vals) else sum((x * y for x, y in vals), 0)
        if bias is not None:
            bt = ln.f(bias)
            expr += f" + {bt}"
            exact = None if exact is None or shown(bt) is None else exact + shown(bt)
        return f"{lhs} = {expr} {ln.rel(exact, value)}"
    return fit(precision, build)


def _div(a, b):
    """a / b of two shown numbers (Decimals), None when either is missing or b is 0."""
    return None if a is None or b is None or b == 0 else a / b


def _exp_of(x_text: str, m_text: str):
    """exp(x − m) of two shown numbers."""
    x, m = shown(x_text), shown(m_text)
    if x is None or m is None:
        return None
    try:
        return math.exp(float(x - m))
    except OverflowError:
        return None


def _scale_line(lhs: str | None, s, sqrt, sc, value, p: int) -> str:
    """``lhs = s / √d = value`` (or ``s × scale = value``; without ``lhs`` from ``s``), adding up."""
    pre = "" if lhs is None else f"{lhs} = "

    def build(ln) -> str:
        st = ln.n(s)
        if sqrt is not None:
            dt = ln.n(sqrt)
            return f"{pre}{st} / {dt} {ln.rel(_div(shown(st), shown(dt)), value)}"
        ft = ln.n(sc)
        exact = None if shown(st) is None or shown(ft) is None else shown(st) * shown(ft)
        return f"{pre}{st} × {ft} {ln.rel(exact, value)}"
    return fit(p, build)


def _exp_part(x, m, e, p: int) -> str:
    """``exp(x − m) = e`` (``exp(−∞) = 0`` for a masked score), adding up."""
    if np.isneginf(x):
        return "exp(−∞) = 0"

    def build(ln) -> str:
        xt, mt = ln.n(x), ln.f(m)
        return f"exp({xt} − {mt}) {ln.rel(_exp_of(xt, mt), e)}"
    return fit(p, build)


def _ratio_part(e, tot, w, p: int) -> str:
    """``e / sum = w``, adding up."""
    def build(ln) -> str:
        et, tt = ln.n(e), ln.n(tot)
        return f"{et} / {tt} {ln.rel(_div(shown(et), shown(tt)), w)}"
    return fit(p, build)


def _sum_line(head: str, exps, sink_exp, tot, p: int) -> str:
    """``sum = e1 + e2 + … (+ sink) = tot``, adding up."""
    def build(ln) -> str:
        parts = [ln.n(v) for v in exps] + ([] if sink_exp is None else [ln.n(sink_exp)])
        vals = [shown(x) for x in parts]
        exact = None if any(v is None for v in vals) else sum(vals, 0)
        return f"{head} = " + " + ".join(parts) + f" {ln.rel(exact, tot)}"
    return fit(p, build)


def _limited_slices(step, trace, lang):
    sl = _slices(step, trace, lang)
    if len(sl) <= MAX_SLICES:
        return sl, None
    shown = sl[0][0]
    return sl[:1], t("explain.slices_more", lang, shown=shown, rest=len(sl) - 1)


# ----------------------------------------------------------------------------------------------- sections
class _Builder:
    def __init__(self, trace: Trace, lang: str, precision: int, labels: _Labels):
        self.trace, self.lang, self.p, self.lab = trace, lang, precision, labels
        self.n = 0

    def section(self, step: Step, title: str, shape: str | None = None, formula: str | None = None) -> Section:
        self.n += 1
        return Section(step=step.name, title=f"{t('explain.step', self.lang, n=self.n)} · {title}",
                       formula=formula if formula is not None else step.formula,
                       shape=shape if shape is not None else _step_shape(step))

    def row_labels(self, step: Step, name: str | None = None) -> list[str]:
        """Labels of the rows the step's array holds (all, or a row-sampled step's)."""
        labels = self.lab.rows(name or step.name, full_shape(step)[-2])
        ids = held_rows(step)
        return labels if ids is None else [labels[i] for i in ids]

    def table(self, step: Step, name: str, mat, idx, kind: str = "num", row_name: str | None = None,
              col_name: str | None = None) -> Table:
        """The table of one 2-D slice ``mat`` (= the step's array at ``idx``, or a same-shaped operand)."""
        ids = held_rows(step)
        summary = None
        if ids is not None and kind == "num" and step.params.get("stats") is not None:
            summary = step.params["stats"].get(tuple(int(i) for i in idx))
        return _table(name, mat, self.row_labels(step, row_name), self.lab.cols(col_name or step.name, mat.shape[1]),
                      self.lang, self.p, kind, row_ids=ids, n_rows=full_shape(step)[-2], summary=summary,
                      dtype=np.asarray(step.array).dtype)

    def result_tables(self, sec: Section, step: Step, name: str | None = None, kind: str = "num"):
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            mat = np.asarray(step.array[idx])
            tb_name = (name or step.name) + (f" [{label}]" if label else "")
            sec.table(self.table(step, tb_name, mat.astype(bool) if kind == "bool" else mat.astype(np.float64), idx,
                                 kind))
        if more:
            sec.text(more)

    # -- inputs
    def input(self, step: Step) -> Section:
        key = {"X": "explain.t_X", "X_kv": "explain.t_X_kv", "Q": "explain.t_in_Q", "K": "explain.t_in_K",
               "V": "explain.t_in_V", "scores": "explain.t_in_scores"}.get(step.name)
        title = t(key, self.lang) if key else t("explain.t_in_other", self.lang, name=step.name)
        sec = self.section(step, title, formula="")
        sec.formula = None
        self.result_tables(sec, step)
        return sec

    # -- matrix products
    def matmul(self, step: Step) -> Section:
        b = step.operands["b"]
        name = step.name
        bias = step.operands.get("bias")
        if name == "scores":
            title = t("explain.t_scores", self.lang)
            shape = f"{_operand_shape(step, 'a')} · {_operand_shape(step, 'b')}ᵀ → {_step_shape(step)}"
        elif name == "output":
            title = t("explain.t_output", self.lang)
            shape = f"{_operand_shape(step, 'a')} · {_operand_shape(step, 'b')} → {_step_shape(step)}"
        else:
            key = {"Q": "explain.t_Q", "K": "explain.t_K", "V": "explain.t_V",
                   "final_output": "explain.t_final_output"}.get(name, "explain.t_matmul")
            title = t(key, self.lang, formula=step.formula)
            shape = f"{_operand_shape(step, 'a')} · {_operand_shape(step, 'b')} → {_step_shape(step)}"
        sec = self.section(step, title, shape=shape)
        a_name = step.params.get("a_name", "A")
        b_name = step.params.get("b_name", "B")
        if name == "scores":
            sec.text(t("explain.n_scores", self.lang))
        elif name == "output":
            sec.text(t("explain.n_output", self.lang))
        else:
            if b.ndim == 2:                              # the weight matrix, shown once
                sec.table(_table(b_name, np.asarray(b, dtype=np.float64), [str(i) for i in range(b.shape[0])],
                                 [str(j) for j in range(b.shape[1])], self.lang, self.p, dtype=np.asarray(b).dtype))
                if bias is not None:
                    bv = np.asarray(bias, dtype=np.float64)[None, :]
                    sec.table(_table(f"b_{b_name[2:]}", bv, ["b"], [str(j) for j in range(bv.shape[1])],
                                     self.lang, self.p))
            sec.text(t("explain.n_proj", self.lang, a=a_name, b=b_name if name != "scores" else "Kᵀ"))
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            mat = np.asarray(step.array[idx])
            lines, cells = self._cells(step, mat)
            for i, j in cells:
                terms = step.terms((*idx, i, j))
                lhs = self._element_name(step, i, j)
                bv = None if bias is None else float(np.asarray(bias)[j])
                lines.append(((label + ": ") if label else "") + _product_line(lhs, terms, mat[i, j], self.p, bv,
                                                                                      self.lang))
            sec.calc(lines)
        if more:
            sec.text(more)
        self.result_tables(sec, step)
        return sec

    def _cells(self, step: Step, mat) -> tuple[list[str], list[tuple[int, int]]]:
        """The (local row, column) cells whose arithmetic is written out: every one of a small slice, else the
        first (with a line saying so). Never a list of all cells of a large one."""
        R, C = full_shape(step)[-2], mat.shape[-1]
        if R * C > MAX_CALC or mat.shape[0] != R:
            return [t("explain.one_element", self.lang, n=R * C)], [(0, 0)]
        return [], [(i, j) for i in range(R) for j in range(C)]

    def _element_name(self, step: Step, i: int, j: int) -> str:
        """The name of element (i, j) of the step's array (i a local row: a row-sampled step's true row is used)."""
        i = _true_row(step, i)
        if step.name in KEYS_AS_COLS:
            return f"{step.name}[{self.lab.query(i)}, {self.lab.key(j)}]"
        return f"{step.name}[{self.lab.rows(step.name, i + 1)[i]}, {j}]"

    # -- scale
    def scale(self, step: Step) -> Section:
        sc = float(step.params.get("scale", float("nan")))
        d_k = step.params.get("d_k")
        default = bool(step.params.get("is_default"))
        if default and d_k is not None:
            sqrt = math.sqrt(float(d_k))
            sec = self.section(step, t("explain.t_scaled", self.lang))
            sec.text(t("explain.n_scaled", self.lang, d=_dk(d_k), sqrt=fmt(sqrt, self.p), scale=fmt(sc, self.p)))
        else:
            sqrt = None
            sec = self.section(step, t("explain.t_scaled_custom", self.lang, scale=fmt(sc, self.p)))
            sec.text(t("explain.n_scaled_custom", self.lang, scale=fmt(sc, self.p)))
        src = step.operands.get("scores")
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            mat = np.asarray(step.array[idx])
            lines, cells = self._cells(step, mat)
            for i, j in cells:
                s = float(np.asarray(src[idx])[i, j]) if src is not None else float("nan")
                lines.append(((label + ": ") if label else "") +
                             _scale_line(self._element_name(step, i, j), s, sqrt, sc, mat[i, j], self.p))
            sec.calc(lines)
        if more:
            sec.text(more)
        self.result_tables(sec, step)
        return sec

    # -- mask
    def mask(self, step: Step) -> Section:
        sec = self.section(step, t("explain.t_masked", self.lang))
        m = step.operands.get("mask")
        if m is not None and np.asarray(m).dtype == np.bool_:
            sec.text(t("explain.n_mask", self.lang))
            full = np.broadcast_to(np.asarray(m), step.array.shape)
            slices, more = _limited_slices(step, self.trace, self.lang)
            first = full[slices[0][1]]
            same = all(np.array_equal(full[idx], first) for _, idx in _slices(step, self.trace, self.lang))
            source = step.params.get("source")
            if source is not None:                       # which keys each query may see, and why
                sec.text(t("explain.n_mask_why", self.lang))
                lines = var.mask_rules(source, self.lang, self.p)
                if same:
                    prev = None
                    for i in shown_rows(step):
                        qi = _true_row(step, i)
                        if prev is not None and qi != prev + 1:
                            lines.append("…")
                        lines.append(var.mask_row_line(source, first[i], qi, self.lab.query(qi), self.lab.key,
                                                       self.lang, self.lab.k is not None))
                        prev = qi
                    if prev is not None and prev < full_shape(step)[-2] - 1:
                        lines.append("…")
                sec.calc(lines)
            for label, idx in (slices[:1] if same else slices):
                sec.table(self.table(step, "mask" + (f" [{label}]" if label and not same else ""), full[idx], idx,
                                     "bool", row_name="scores", col_name="scores"))
        else:
            sec.text(t("explain.n_mask_float", self.lang))
        self.result_tables(sec, step)
        return sec

    # -- softmax
    def softmax(self, step: Step) -> Section:
        sec = self.section(step, t("explain.t_weights", self.lang), formula=softmax_formula(step, self.trace))
        sec.text(t("explain.n_softmax", self.lang))
        if step.operands.get("sinks") is not None:
            sec.text(t("explain.n_sinks", self.lang))
        e, total, mx, logits = (step.operands.get(k) for k in ("exp", "sum", "max", "logits"))
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            w = np.asarray(step.array[idx])
            R, C = full_shape(step)[-2], w.shape[-1]
            rows = range(R) if (R <= SMALL and C <= SMALL and w.shape[0] == R) else range(1)
            lines = []
            if e is not None and total is not None and mx is not None and logits is not None:
                for i in rows:
                    lines += self._softmax_row(label, idx, i, w, e, total, mx, logits, step)
            if len(rows) < R:
                lines.append(t("explain.one_element", self.lang, n=R))
            sec.calc(lines)
        if more:
            sec.text(more)
        self.result_tables(sec, step)
        return sec

    def _softmax_row(self, label, idx, i, w, e, total, mx, logits, step=None) -> list[str]:
        p = self.p
        x = np.asarray(logits[idx])[i]
        ex = np.asarray(e[idx])[i]
        tot = float(np.asarray(total[idx])[i, 0])
        m = float(np.asarray(mx[idx])[i, 0])
        C = len(x)
        pre = (label + ": ") if label else ""
        qlabel = self.lab.query(i if step is None else _true_row(step, i))
        lines = [f"{pre}{t('explain.row', self.lang, label=qlabel)}: {t('explain.max', self.lang)} = {fmt(m, p)}"]
        show = range(C) if C <= SMALL else range(SHOW)
        parts = []
        for j in show:
            parts.append(_exp_part(x[j], m, ex[j], p))
        lines.append("  " + ";  ".join(parts) + ("; …" if C > len(show) else ""))
        sink = None if step is None else var.sink_values(step, idx, i)
        if sink is not None:
            lines.append(f"  {t('explain.sink', self.lang)}: {_exp_part(sink[0], m, sink[1], p)}")
        if C <= SMALL:
            lines.append("  " + _sum_line(t('explain.sum', self.lang), ex, None if sink is None else sink[1], tot, p))
        else:
            plus_sink = "" if sink is None else f" + {fmt(sink[1], p)}"
            lines.append(f"  {t('explain.sum', self.lang)} = Σ ({C}){plus_sink} = {fmt(tot, p)}")
        lines.append("  " + "  ".join(
            f"{self.lab.key(j)}: {_ratio_part(ex[j], tot, w[i, j], p)}" for j in show)
            + ("  …" if C > len(show) else ""))
        return lines

    # -- dropout
    def dropout(self, step: Step) -> Section:
        sec = self.section(step, t("explain.t_dropout", self.lang))
        pr = float(step.params.get("p", 0.0))
        sec.text(t("explain.n_dropout", self.lang, keep=fmt(1 - pr, self.p)))
        self.result_tables(sec, step)
        return sec

    # -- reshapes
    def split(self, step: Step) -> Section:
        src = step.name[:-len("_heads")]
        x = step.operands.get("x")
        sec = self.section(step, t("explain.t_heads", self.lang, name=src))
        sec.text(t("explain.n_split", self.lang, src=src, src_shape=_shape(x) if x is not None else "?", name=step.name,
                   shape=_shape(step.array)))
        self.result_tables(sec, step)
        return sec

    def repeat(self, step: Step) -> Section:
        x = step.operands.get("x")
        sec = self.section(step, t("explain.t_repeated", self.lang, name=step.name))
        sec.text(t("explain.n_repeat", self.lang, n=step.params.get("n_rep", "?"),
                   hk=(np.shape(x)[-3] if x is not None and np.ndim(x) >= 3 else "?")))
        return sec

    def concat(self, step: Step) -> Section:
        x = step.operands.get("x")
        sec = self.section(step, t("explain.t_concat", self.lang))
        sec.text(t("explain.n_concat", self.lang, src_shape=_shape(x) if x is not None else "?", shape=_shape(step.array)))
        self.result_tables(sec, step)
        return sec

    # -- RoPE
    def rope(self, step: Step) -> Section:
        src = step.name.split("_")[0]
        theta = step.params.get("theta")
        sec = self.section(step, t("explain.t_rope", self.lang, name=step.name, src=src,
                                   style=step.params.get("style", "neox"),
                                   theta=fmt(theta, self.p) if theta is not None else "?"))
        for line in var.rope_note(step, self.lang, self.p):
            sec.text(line)
        if all(step.operands.get(k) is not None for k in ("x", "cos", "sin")):
            slices, more = _limited_slices(step, self.trace, self.lang)
            half = step.array.shape[-1] // 2
            for label, idx in slices:
                R = step.array.shape[-2]
                lines = []
                if R * half > MAX_CALC:
                    lines.append(t("explain.one_element", self.lang, n=R * half))
                    rows, pairs = [0], [0]
                else:
                    rows, pairs = range(R), None
                for i in rows:
                    rl = self.lab.rows(step.name, R)[i]
                    lines += [((label + ": ") if label else "") + ln
                              for ln in var.rope_lines(step, idx, i, rl, self.p, pairs)]
                sec.calc(lines)
            if more:
                sec.text(more)
        self.result_tables(sec, step)
        return sec

    # -- ALiBi and soft-capping: one line per score
    def _elementwise(self, sec: Section, step: Step, line) -> None:
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            lines, cells = self._cells(step, np.asarray(step.array[idx]))
            for i, j in cells:
                lines.append(((label + ": ") if label else "") + line(idx, i, j, self._element_name(step, i, j)))
            sec.calc(lines)
        if more:
            sec.text(more)

    def bias(self, step: Step) -> Section:
        slopes = var.slopes_text(step, self.p)
        if slopes is not None:
            sec = self.section(step, t("explain.t_alibi", self.lang))
            sec.text(t("explain.n_alibi", self.lang, slopes=slopes))
        else:
            sec = self.section(step, t("explain.t_bias", self.lang))
            sec.text(t("explain.n_bias", self.lang))
        if step.operands.get("scaled") is not None:
            self._elementwise(sec, step, lambda idx, i, j, lhs: var.bias_line(step, idx, i, j, lhs, self.p,
                                                                              qi=_true_row(step, i)))
        self.result_tables(sec, step)
        return sec

    def softcap(self, step: Step) -> Section:
        cap = fmt(step.params.get("cap", float("nan")), self.p)
        sec = self.section(step, t("explain.t_softcap", self.lang, cap=cap))
        sec.text(t("explain.n_softcap", self.lang, cap=cap))
        if step.operands.get("scores") is not None:
            self._elementwise(sec, step, lambda idx, i, j, lhs: var.softcap_line(step, idx, i, j, lhs, self.p))
        self.result_tables(sec, step)
        return sec

    def step(self, step: Step) -> Section | None:
        if step.op == "input":
            return self.input(step)
        if step.op == "matmul":
            return self.matmul(step)
        if step.op == "scale":
            return self.scale(step)
        if step.op == "mask":
            return self.mask(step)
        if step.op == "softmax":
            return self.softmax(step)
        if step.op == "dropout":
            return self.dropout(step)
        if step.op == "reshape" and step.name.endswith("_heads"):
            return self.split(step)
        if step.op == "reshape" and step.name == "concat":
            return self.concat(step)
        if step.op == "repeat":
            return self.repeat(step)
        if step.op == "rope":
            return self.rope(step)
        if step.op == "bias":
            return self.bias(step)
        if step.op == "softcap":
            return self.softcap(step)
        if step.op == "score_mod":
            sec = self.section(step, t("explain.t_modified", self.lang, fn=step.params.get("fn", "score_mod")))
            self.result_tables(sec, step)
            return sec
        sec = self.section(step, step.name)
        self.result_tables(sec, step)
        return sec


def _token_list(tokens: list[str], most: int = 24) -> str:
    """The tokens, space-separated; a long list as its first 16 … last 4 and the count."""
    if len(tokens) <= most:
        return " ".join(tokens)
    return " ".join(tokens[:16]) + " … " + " ".join(tokens[-4:]) + f" ({len(tokens)})"


def build_doc(trace: Trace, *, lang: str = "en", precision: int = 4, tokens=None, kv_tokens=None,
              title: str | None = None) -> Doc:
    """The document of a whole trace (see :func:`render`)."""
    tokens, kv_tokens = _check_common(trace, lang, "text", precision, tokens, kv_tokens)
    labels = _Labels(trace, tokens, kv_tokens)
    doc = Doc(title=title or t("explain.doc_title", lang), lang=lang)
    doc.intro.append(t("explain.overview_mha" if "Q_heads" in trace else "explain.overview", lang))
    if tokens is not None:
        doc.intro.append(f"{t('explain.tokens', lang)}: {_token_list(tokens)}")
    if kv_tokens is not None:
        doc.intro.append(f"{t('explain.kv_tokens', lang)}: {_token_list(kv_tokens)}")
    b = _Builder(trace, lang, precision, labels)
    for step in trace:
        sec = b.step(step)
        if sec is not None:
            doc.sections.append(sec)
    return doc


def render(trace: Trace, *, lang: str = "en", fmt: str = "text", precision: int = 4, tokens=None,
           kv_tokens=None, title: str | None = None) -> str:
    """The whole calculation recorded in ``trace``, as a textbook writes it.

    Args:
        trace: a :class:`qkv.Trace` (from :func:`qkv.explain.examples.run`, ``qkv.attention(..., trace=t)``,
            ``MultiHeadAttention.forward(..., trace=t)``, ...).
        lang: ``"en"`` or ``"zh"``.
        fmt: ``"text"``, ``"markdown"`` or ``"json"`` (a JSON document of sections; −∞ is ``null``).
        precision: decimals shown (trailing zeros dropped).
        tokens, kv_tokens: labels of the query rows and key rows.
        title: the heading (default: "Scaled dot-product attention, step by step").
    """
    _check_common(trace, lang, fmt, precision, tokens, kv_tokens)
    doc = build_doc(trace, lang=lang, precision=precision, tokens=tokens, kv_tokens=kv_tokens, title=title)
    return _doc.emit(doc, fmt, precision)


# ----------------------------------------------------------------------------------------------- one query
def _lead_index(arr: np.ndarray, head: int, batch: int, what: str) -> tuple:
    lead = arr.shape[:-2]
    for name, v in (("head", head), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if len(lead) == 0:
        if head != 0 or batch != 0:
            raise ValueError(f"head/batch: the trace's {what} has shape {arr.shape} (one head, no batch); expected "
                             f"head=0 and batch=0, got head={head}, batch={batch}")
        return ()
    if len(lead) == 1:
        if batch != 0:
            raise ValueError(f"batch: the trace's {what} has shape {arr.shape} (heads, L, S), no batch; expected 0, "
                             f"got {batch}")
        if not 0 <= head < lead[0]:
            raise ValueError(f"head: expected 0..{lead[0] - 1}, got {head}")
        return (head,)
    nb, nh = int(np.prod(lead[:-1])), lead[-1]
    if not 0 <= head < nh:
        raise ValueError(f"head: expected 0..{nh - 1}, got {head}")
    if not 0 <= batch < nb:
        raise ValueError(f"batch: expected 0..{nb - 1}, got {batch}")
    return tuple(np.unravel_index(batch, lead[:-1])) + (head,)


def _bcast(a, shape):
    return np.broadcast_to(np.asarray(a), shape)


def build_query_doc(trace: Trace, row: int, *, head: int = 0, batch: int = 0, lang: str = "en",
                    precision: int = 4, tokens=None, kv_tokens=None) -> Doc:
    tokens, kv_tokens = _check_common(trace, lang, "text", precision, tokens, kv_tokens)
    if "weights" not in trace:
        raise ValueError(f"trace: expected a 'weights' step (the softmax), got steps {trace.names()}")
    w_step = trace["weights"]
    W = w_step.array
    idx = _lead_index(W, head, batch, "weights")
    L, S = full_shape(w_step)[-2:]
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
        raise TypeError(f"row: expected an int (the query's 0-based row), got {type(row).__name__}")
    if not 0 <= row < L:
        raise ValueError(f"row: expected 0..{L - 1} (the query rows), got {row}")
    row = int(row)

    def loc(step: Step) -> int:
        """Where the query's row is in this step's array (a row-sampled step holds only some rows)."""
        return _local_row(step, row)
    lab = _Labels(trace, tokens, kv_tokens)
    p = precision
    qlabel = lab.query(row)
    where = []
    if len(W.shape) >= 3:
        where.append(t("explain.head", lang, h=head))
    if len(W.shape) >= 4 and int(np.prod(W.shape[:-3])) > 1:
        where.append(t("explain.batch", lang, b=batch))
    doc = Doc(title=t("explain.q_title", lang, label=qlabel, where=(" (" + ", ".join(where) + ")") if where else ""),
              lang=lang)
    doc.intro.append(t("explain.overview", lang))
    w = np.asarray(W[idx])[loc(w_step)].astype(np.float64)           # (S,)
    # which keys to write out: all when few, else the largest weights
    if S <= 16:
        keys = list(range(S))
        keys_note = None
    else:
        keys = sorted(np.argsort(-w, kind="stable")[:SMALL].tolist())
        rest = [j for j in range(S) if j not in keys]
        keys_note = t("explain.q_keys_more", lang, k=len(keys), n=S, rest=len(rest), w=fmt(w[rest].sum(), p))
    n = 0

    def sec(step, title, formula=None, shape=None):
        nonlocal n
        n += 1
        s = Section(step=step, title=f"{t('explain.step', lang, n=n)} · {title}", formula=formula, shape=shape)
        doc.sections.append(s)
        return s

    scores_step = trace["scores"] if "scores" in trace else None
    rot = trace["Q_rot"] if "Q_rot" in trace else None
    if rot is not None and rot.array.shape[:-2] == W.shape[:-2] and rot.operands.get("x") is not None:
        E = rot.array.shape[-1]
        s = sec("Q_rot", t("explain.q_rope", lang, label=qlabel), formula=rot.formula, shape=f"({E},)")
        for line in var.rope_note(rot, lang, p):
            s.text(line)
        half = E // 2
        lines = var.rope_lines(rot, idx, loc(rot), qlabel, p, None if half <= SMALL else range(SHOW // 2))
        if half > SMALL:
            lines.append(t("explain.pairs_more", lang, n=half))
        s.calc(lines)
        if "K_rot" in trace:
            s.text(t("explain.q_rope_keys", lang))
    if scores_step is not None and scores_step.op == "matmul":
        qa = scores_step.operands["a"]
        lead_shape = scores_step.array.shape[:-2]
        qa = _bcast(qa, lead_shape + qa.shape[-2:])
        q = np.asarray(qa[idx])[loc(scores_step)]
        E = q.shape[-1]
        qname = "Q_rot" if rot is not None else "Q_heads" if "Q_heads" in trace else "Q"
        s = sec("Q", t("explain.q_vec", lang, name=qname, label=qlabel), shape=f"({E},)")
        s.table(_table("q", q[None, :].astype(np.float64), [qlabel], [str(k) for k in range(E)], lang, p))
        s = sec("scores", t("explain.q_scores", lang), formula="scores[q, j] = q · k_j",
                shape=f"({S},)")
        arr = np.asarray(scores_step.array[idx])[loc(scores_step)]
        lines = []
        for j in keys:
            terms = scores_step.terms((*idx, loc(scores_step), j))
            lines.append(_product_line(f"q · k_{lab.key(j)}", terms, arr[j], p, lang=lang))
        s.calc(lines)
        if keys_note:
            s.text(keys_note)
    elif scores_step is not None:
        s = sec("scores", t("explain.t_in_scores", lang), shape=f"({S},)")
        s.text(t("explain.q_given", lang))
        arr = np.asarray(_bcast(scores_step.array, full_shape(w_step))[idx])[loc(scores_step)]
        s.table(_table("scores", arr[None, :].astype(np.float64), [qlabel], [lab.key(j) for j in range(S)], lang, p))
    if "scaled" in trace:
        st = trace["scaled"]
        sc = float(st.params.get("scale", float("nan")))
        d_k = st.params.get("d_k")
        s = sec("scaled", t("explain.q_scaled", lang), formula=st.formula)
        if st.params.get("is_default") and d_k is not None:
            sq = math.sqrt(float(d_k))
            s.text(t("explain.n_scaled", lang, d=_dk(d_k), sqrt=fmt(sq, p), scale=fmt(sc, p)))
            op = f"/ {fmt(sq, p)}"
        else:
            s.text(t("explain.n_scaled_custom", lang, scale=fmt(sc, p)))
            op = f"× {fmt(sc, p)}"
        src = st.operands.get("scores")
        vals = np.asarray(st.array[idx])[loc(st)]
        srow = None if src is None else np.asarray(_bcast(src, st.array.shape)[idx])[loc(st)]
        s.calc([f"{lab.key(j)}: " + (_scale_line(None, srow[j], sq if op.startswith("/") else None, sc, vals[j], p)
                                     if srow is not None else f"? {op} = {fmt(vals[j], p)}") for j in keys])
    for name in ("biased", "capped", "modified"):
        if name not in trace or trace[name].array.shape != W.shape:
            continue
        st = trace[name]
        if st.op == "bias":
            slopes = var.slopes_text(st, p)
            s = sec(name, t("explain.t_alibi" if slopes else "explain.t_bias", lang), formula=st.formula)
            s.text(t("explain.n_alibi", lang, slopes=slopes) if slopes else t("explain.n_bias", lang))
            if st.operands.get("scaled") is not None:
                s.calc([var.bias_line(st, idx, loc(st), j, lab.key(j), p, qi=row) for j in keys])
        elif st.op == "softcap":
            cap = fmt(st.params.get("cap", float("nan")), p)
            s = sec(name, t("explain.t_softcap", lang, cap=cap), formula=st.formula)
            s.text(t("explain.n_softcap", lang, cap=cap))
            if st.operands.get("scores") is not None:
                s.calc([var.softcap_line(st, idx, loc(st), j, lab.key(j), p) for j in keys])
        else:
            s = sec(name, t("explain.t_modified", lang, fn=st.params.get("fn", "score_mod")), formula=st.formula)
        vals = np.asarray(st.array[idx])[loc(st)]
        s.table(_table(name, vals[keys][None, :].astype(np.float64), [qlabel], [lab.key(j) for j in keys], lang, p))
    if "masked" in trace:
        mk = trace["masked"]
        s = sec("masked", t("explain.q_mask", lang), formula=mk.formula)
        m = mk.operands.get("mask")
        vals = np.asarray(mk.array[idx])[loc(mk)]
        if m is not None and np.asarray(m).dtype == np.bool_:
            mrow = np.asarray(_bcast(m, mk.array.shape)[idx])[loc(mk)]
            s.text(t("explain.n_mask", lang))
            source = mk.params.get("source")
            if source is not None:
                s.calc(var.mask_rules(source, lang, p) +
                       [var.mask_row_line(source, mrow, row, qlabel, lab.key, lang, lab.k is not None)])
            cols = keys
            s.table(Table("mask", [qlabel], [lab.key(j) for j in cols], [[bool(mrow[j]) for j in cols]], "bool"))
        else:
            s.text(t("explain.n_mask_float", lang))
        s.table(_table("masked", vals[keys][None, :].astype(np.float64), [qlabel], [lab.key(j) for j in keys],
                       lang, p))
    # softmax
    s = sec("weights", t("explain.q_softmax", lang), formula=softmax_formula(w_step, trace))
    s.text(t("explain.n_softmax", lang))
    sink = var.sink_values(w_step, idx, loc(w_step))
    if sink is not None:
        s.text(t("explain.n_sinks", lang))
    e, total, mx, logits = (w_step.operands.get(k) for k in ("exp", "sum", "max", "logits"))
    if all(v is not None for v in (e, total, mx, logits)):
        r = loc(w_step)
        x = np.asarray(logits[idx])[r]
        ex = np.asarray(e[idx])[r]
        tot = float(np.asarray(total[idx])[r, 0])
        m = float(np.asarray(mx[idx])[r, 0])
        lines = [f"{t('explain.max', lang)} = {fmt(m, p)}"]
        for j in keys:
            if np.isneginf(x[j]):
                lines.append(f"{lab.key(j)}: exp(−∞) = 0 → 0")
            else:
                lines.append(f"{lab.key(j)}: {_exp_part(x[j], m, ex[j], p)} → {_ratio_part(ex[j], tot, w[j], p)}")
        if S <= SMALL:
            lines.insert(1, _sum_line(t('explain.sum', lang), ex, None if sink is None else sink[1], tot, p))
        else:
            plus_sink = "" if sink is None else f" + {fmt(sink[1], p)}"
            lines.insert(1, f"{t('explain.sum', lang)} = Σ ({S}){plus_sink} = {fmt(tot, p)}")
        if sink is not None:
            lines.insert(1, f"{t('explain.sink', lang)}: {_exp_part(sink[0], m, sink[1], p)}")
        s.calc(lines)
    if keys_note:
        s.text(keys_note)
    s.table(_table("weights", w[keys][None, :], [qlabel], [lab.key(j) for j in keys], lang, p))
    # dropout
    if "dropout" in trace:
        d = trace["dropout"]
        s = sec("dropout", t("explain.t_dropout", lang), formula=d.formula)
        s.text(t("explain.n_dropout", lang, keep=fmt(1 - float(d.params.get("p", 0.0)), p)))
        dv = np.asarray(d.array[idx])[loc(d)]
        s.table(_table("dropout", dv[keys][None, :].astype(np.float64), [qlabel], [lab.key(j) for j in keys],
                       lang, p))
    # weighted sum
    if "output" in trace and trace["output"].op == "matmul":
        o = trace["output"]
        out = np.asarray(o.array[idx])[loc(o)]
        Ev = out.shape[-1]
        s = sec("output", t("explain.q_out", lang), formula=o.formula, shape=f"({Ev},)")
        s.text(t("explain.n_output", lang))
        lines = []
        cols = range(Ev) if Ev <= SMALL else range(SHOW)
        for c in cols:
            terms = o.terms((*idx, loc(o), c))
            if S > 16:
                terms_shown = [terms[j] for j in keys]
                expr = " + ".join(f"{fmt_factor(a, p)}×{fmt_factor(b, p)}" for a, b in terms_shown)
                lines.append(f"output[{qlabel}, {c}] = {expr} + {t('explain.terms_more', lang, n=S)} = "
                             f"{fmt(out[c], p)}")
            else:
                lines.append(_product_line(f"output[{qlabel}, {c}]", terms, out[c], p, lang=lang))
        if Ev > len(cols):
            lines.append(t("explain.terms_more", lang, n=Ev))
        s.calc(lines)
        s.table(_table("output", out[None, :].astype(np.float64), [qlabel], [str(c) for c in range(Ev)], lang, p))
        if "final_output" in trace and "concat" in trace:
            s.text(t("explain.q_after", lang))
        elif "concat" in trace:
            s.text(t("explain.q_after_concat", lang))
    return doc


def explain_query(trace: Trace, row: int, *, head: int = 0, batch: int = 0, lang: str = "en", fmt: str = "text",
                  precision: int = 4, tokens=None, kv_tokens=None) -> str:
    """One query's whole calculation: its q, q·k for every key, scaling, mask, softmax, weighted sum.

    Works on single-head traces (arrays (L, S)), on SDPA traces (..., H, L, S) and on multi-head traces
    (B, H, L, S) such as a BERT layer's; with many keys or wide heads it writes out the keys with the
    largest weights and summarizes the rest.

    Args:
        trace: a :class:`qkv.Trace` with at least a ``weights`` step.
        row: the query's 0-based row.
        head, batch: which head and batch element (multi-head traces).
        lang, fmt, precision, tokens, kv_tokens: as in :func:`render`.
    """
    _check_common(trace, lang, fmt, precision, tokens, kv_tokens)
    doc = build_query_doc(trace, row, head=head, batch=batch, lang=lang, precision=precision, tokens=tokens,
                          kv_tokens=kv_tokens)
    return _doc.emit(doc, fmt, precision)
