"""Check a worked example: every claimed number is ``correct``, ``carried`` or ``wrong``.

- ``expected``: the true value, from :func:`qkv.explain.examples.run` (qkv's own computation path).
- ``recomputed``: what follows from the file's own earlier claims — the same pipeline
  (:func:`qkv.pipeline.attend`, through :func:`~qkv.explain.examples.run`) under a :class:`qkv.Trace` whose
  ``substitute`` puts every claimed number in place of the value it claims as the computation goes.
- A claim *matches* a value when ``|claimed − value| ≤ max(half a unit in the last decimal place as written,
  0.1% of |value|)``, or ``≤ tolerance`` when the file sets one.
- ``correct``: matches the true value. ``carried``: does not, but matches the recomputed value (an inherited
  error: an earlier slip, or rounding). ``wrong``: matches neither — a new mistake at this step (a root).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from qkv.explain import doc as _doc
from qkv.explain.doc import Doc, Section, fmt
from qkv.locales import check_lang, t
from qkv.explain.examples import CLAIM_NAMES, KEY_SIDE, Worked, half_unit, is_large, load_file, run, run_rows, text_of

__all__ = ["check", "CheckReport", "ClaimResult", "matches"]

STATUSES = ("correct", "carried", "wrong")


def matches(claimed, value: float, tolerance: float | None = None) -> bool:
    """The issue's rule: ``|claimed − value| ≤ max(half a unit in the last decimal as written, 0.1% of |value|)``
    (or ``≤ tolerance`` when given). ``claimed`` keeps its text (a :class:`~qkv.explain.examples.Number`);
    a plain float is taken as written by ``repr``."""
    v = float(value)
    if not math.isfinite(v):
        return False
    diff = abs(float(claimed) - v)
    slack = 1e-12 * max(1.0, abs(v))                       # binary floating point, not a tolerance
    if tolerance is not None:
        return diff <= tolerance + slack
    return diff <= max(half_unit(claimed), 1e-3 * abs(v)) + slack


@dataclass
class ClaimResult:
    name: str
    row: int
    col: int
    label: str | None
    claimed: float
    expected: float
    recomputed: float
    status: str
    text: str = ""                                         # the claimed number as written
    width: int = 0                                         # the number of columns of the claimed matrix

    def to_dict(self) -> dict:
        return {"name": self.name, "row": self.row, "col": self.col, "label": self.label,
                "claimed": float(self.claimed), "expected": _json_float(self.expected),
                "recomputed": _json_float(self.recomputed), "status": self.status}


def _json_float(x):
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
class CheckReport:
    """The verdict on every claimed number (in pipeline order: Q, K, V, scores, scaled, weights, output)."""

    claims: list[ClaimResult]
    title: str | None = None
    tolerance: float | None = None
    summary: dict = field(default_factory=dict)

    def __post_init__(self):
        self.summary = {s: sum(c.status == s for c in self.claims) for s in STATUSES}

    @property
    def ok(self) -> bool:
        return all(c.status == "correct" for c in self.claims)

    @property
    def exit_code(self) -> int:
        """0 when every claim is correct, 1 when any is carried or wrong."""
        return 0 if self.ok else 1

    @property
    def roots(self) -> list[ClaimResult]:
        return [c for c in self.claims if c.status == "wrong"]

    @property
    def carried(self) -> list[ClaimResult]:
        return [c for c in self.claims if c.status == "carried"]

    def to_dict(self) -> dict:
        return {"ok": self.ok, "claims": [c.to_dict() for c in self.claims], "summary": dict(self.summary)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=2, allow_nan=False) + "\n"

    def doc(self, lang: str = "en", precision: int = 4) -> Doc:
        check_lang(lang)
        p = precision
        title = t("check.c_title", lang, title=self.title or t("check.untitled", lang))
        doc = Doc(title=title, lang=lang)
        n = len(self.claims)
        doc.intro.append(t("check.c_summary", lang, n=n, **self.summary))
        doc.intro.append(t("check.c_rule_tol", lang, tol=fmt(self.tolerance, 12)) if self.tolerance is not None
                         else t("check.c_rule", lang))
        if n == 0:
            doc.intro.append(t("check.c_none", lang))
        elif self.ok:
            doc.intro.append(t("check.c_ok", lang))
        for status, key in (("wrong", "check.c_roots"), ("carried", "check.c_carried")):
            groups = _groups([c for c in self.claims if c.status == status])
            if not groups:
                continue
            sec = Section(step=status, title=t(key, lang, status=status_word(status, lang)))
            lines = []
            for where, cs in groups:
                claimed = ", ".join(c.text for c in cs)
                true = ", ".join(fmt(c.expected, p) for c in cs)
                line = f"{where}: {t('check.c_claimed', lang)} [{claimed}]  {t('check.c_true', lang)} [{true}]"
                if status == "carried" or any(not _same(c.recomputed, c.expected) for c in cs):
                    rec = ", ".join(fmt(c.recomputed, p) for c in cs)
                    line += f"  {t('check.c_from', lang)} [{rec}]"
                lines.append(line)
            sec.calc(lines)
            doc.sections.append(sec)
        correct = _groups([c for c in self.claims if c.status == "correct"])
        if correct:
            sec = Section(step="correct", title=t("check.c_correct", lang))
            sec.calc([f"{where}: [{', '.join(c.text for c in cs)}]" for where, cs in correct])
            doc.sections.append(sec)
        return doc

    def render(self, lang: str = "en", fmt: str = "text", precision: int = 4) -> str:
        """The report: root mistakes first, then what they carried into, then what is correct."""
        if fmt == "json":
            return self.to_json()
        if fmt not in _doc.FORMATS:
            raise ValueError(f"fmt: expected one of {', '.join(_doc.FORMATS)}, got {fmt!r}")
        return _doc.emit(self.doc(lang, precision), fmt, precision)


def status_word(status: str, lang: str) -> str:
    """A verdict (``correct``, ``carried``, ``wrong``) in ``lang``; the JSON report keeps the English values."""
    return {"correct": t("check.status_correct", lang), "carried": t("check.status_carried", lang),
            "wrong": t("check.status_wrong", lang)}[status]


def _same(a, b) -> bool:
    return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))


def _groups(cs: list[ClaimResult]):
    """Claims grouped by (name, row), each written ``name[label]`` or ``name[label, col …]``."""
    out: dict[tuple, list[ClaimResult]] = {}
    for c in cs:
        out.setdefault((c.name, c.row), []).append(c)
    res = []
    for (name, row), items in out.items():
        label = items[0].label if items[0].label is not None else str(row)
        if len(items) == items[0].width:
            where = f"{name}[{label}]"
        else:
            where = f"{name}[{label}, {' '.join(str(c.col) for c in items)}]"
        res.append((where, items))
    return res


# ----------------------------------------------------------------------------------------------- the check
class _Kept:
    """A step kept at some query rows only (:func:`~qkv.explain.examples.run_rows`), read as the whole
    (rows, cols) matrix it stands for: ``kept[i, j]`` for a kept row ``i``; ``shape`` is the whole shape."""

    def __init__(self, array: np.ndarray, rows, shape: tuple[int, int]):
        self.array, self.shape = array, shape
        self.pos = {int(r): k for k, r in enumerate(rows)}

    def __getitem__(self, ij):
        i, j = ij
        return self.array[self.pos[i], j]


def _as_2d(a) -> np.ndarray | None:
    """A recorded array as the (rows, cols) matrix a claim addresses, or None when it has real leading dims
    (several heads: per-head steps cannot be claimed)."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim < 2 or int(np.prod(a.shape[:-2])) != 1:
        return None
    return a.reshape(a.shape[-2:])


def _values(tr) -> dict:
    """The claimable steps of a trace as (rows, cols) matrices: each stage's own computed value (a step kept
    at some rows only as a :class:`_Kept`)."""
    vals = {}
    for name in CLAIM_NAMES:
        if name in tr:
            step = tr[name]
            a = _as_2d(step.array)
            if a is not None and "rows" in step.params:
                a = _Kept(a, step.params["rows"], tuple(step.params["full_shape"][-2:]))
            if a is not None:
                vals[name] = a
    return vals


class _PutClaims:
    """A trace's ``substitute``: every claimed number is put in place of the value it claims, so each later
    stage computes from the claims (the stage's own value stays in the trace: "what follows from them").
    ``row0``: the true index of the array's first row (a block of query rows, in :func:`run_rows`)."""

    def __init__(self, claims: dict[str, dict[int, list]]):
        self.claims = claims

    def __call__(self, name: str, array: np.ndarray, row0: int = 0) -> np.ndarray:
        rows = self.claims.get(name)
        if not rows or int(np.prod(np.shape(array)[:-2])) != 1:
            return array
        out = np.array(array, copy=True)
        mat = out.reshape(out.shape[-2:])                       # a view: (rows, cols)
        for i, row in rows.items():
            if not row0 <= i < row0 + mat.shape[0]:
                continue
            for j, x in enumerate(row):
                if x is not None:
                    mat[i - row0, j] = float(x)
        return out


def _true_values(worked: Worked, claims: dict) -> tuple[dict, list | None]:
    """The true values of the claimable steps, and the query rows they are kept at (None: every row). A
    large example (:func:`~qkv.explain.examples.is_large`) streams its attention by blocks of query rows and
    keeps the (L, S) steps at the claimed rows only: memory follows the claims, not L × S."""
    if not is_large(worked):
        return _values(run(worked)), None
    rows = sorted({i for name, r in claims.items() if name not in KEY_SIDE for i in r
                   if 0 <= i < worked.n_queries}) or [0]
    return _values(run_rows(worked, rows)), rows


def _recomputed(worked: Worked, claims: dict, rows: list | None) -> dict:
    """What follows from the claims: the same pipeline, each claimed number put in place as it goes."""
    from qkv.core.tracing import Trace

    if rows is None:
        return _values(run(worked, trace=Trace(substitute=_PutClaims(claims))))
    return _values(run_rows(worked, rows, substitute=_PutClaims(claims)))


def check(worked) -> CheckReport:
    """Verify the numbers a worked example claims (see the module docstring for the rule).

    ``expected`` comes from :func:`~qkv.explain.examples.run`; ``recomputed`` from the same run under a
    :class:`qkv.Trace` whose ``substitute`` puts each claimed number in place as the pipeline goes: each
    step's recorded value is then what follows from the claims before it. A large example
    (:func:`~qkv.explain.examples.is_large`) runs both through :func:`~qkv.explain.examples.run_rows`: the
    attention in blocks of query rows, its (L, S) steps kept at the claimed rows only.

    Args:
        worked: a :class:`~qkv.explain.examples.Worked`, or a path to a worked-example file.

    Returns:
        a :class:`CheckReport`: ``.ok``, ``.claims`` (:class:`ClaimResult` each with name, row, col, label,
        claimed, expected, recomputed, status), ``.summary``, ``.to_json()``, ``.render(lang, fmt)``.
    """
    if not isinstance(worked, Worked):
        import os
        if isinstance(worked, (str, os.PathLike)):
            worked = load_file(worked)
        else:
            raise TypeError(f"worked: expected a qkv.explain.examples.Worked or a file path, got "
                            f"{type(worked).__name__}")
    claims = {}
    for name, rows in (worked.claims or {}).items():      # a Worked built in Python may hold plain matrices
        if name not in CLAIM_NAMES:
            raise ValueError(f"worked.claims: unknown name {name!r}; expected one of {', '.join(CLAIM_NAMES)}")
        rows = rows if isinstance(rows, dict) else dict(enumerate(np.atleast_2d(np.asarray(rows, dtype=float))))
        claims[name] = {int(i): list(r) for i, r in rows.items()}
    true, kept = _true_values(worked, claims)
    for name in claims:
        if name not in true:
            raise ValueError(f"worked.claims: this example does not compute {name}")
        for i, r in claims[name].items():
            if not 0 <= i < true[name].shape[0] or len(r) != true[name].shape[1]:
                raise ValueError(f"worked.claims[{name!r}][{i}]: expected a row index 0..{true[name].shape[0] - 1} "
                                 f"and {true[name].shape[1]} numbers, got {len(r)}")
    rec = _recomputed(worked, claims, kept) if claims else true
    results: list[ClaimResult] = []
    for name in CLAIM_NAMES:
        rows = claims.get(name)
        if not rows:
            continue
        key_side = name in KEY_SIDE
        labels_given = worked.kv_tokens_given if (key_side and worked.kv_tokens is not None) else worked.tokens_given
        labels = worked.key_labels if key_side else (worked.tokens or [])
        for i in sorted(rows):
            for j, x in enumerate(rows[i]):
                if x is None:
                    continue
                e = float(true[name][i, j])
                r = float(rec[name][i, j])
                if matches(x, e, worked.tolerance):
                    status = "correct"
                elif matches(x, r, worked.tolerance):
                    status = "carried"
                else:
                    status = "wrong"
                c = ClaimResult(name=name, row=int(i), col=int(j), label=labels[i] if labels_given else None,
                                claimed=float(x), expected=e, recomputed=r, status=status, text=text_of(x),
                                width=len(rows[i]))
                results.append(c)
    return CheckReport(claims=results, title=worked.title or worked.name, tolerance=worked.tolerance)
