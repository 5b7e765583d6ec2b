"""The written-out arithmetic lines of the explainer: products, scaling, exp, ratios and sums that add up.

Each line is formatted with enough decimals that the shown numbers give the shown result (else ``≈``; see
:func:`qkv.explain.doc.fit`).
"""
from __future__ import annotations

import math

import numpy as np

from qkv.core.tracing import Step, Trace
from qkv.explain.doc import fit, fmt, fmt_factor, shown
from qkv.explain._layout import MAX_TERMS
from qkv.locales import t


#: The steps that may come between the scaling and the softmax, last first: the softmax reads the last present.
_BEFORE_SOFTMAX = ("masked", "modified", "capped", "biased", "scaled")


def mask_formula(step: Step, lang: str) -> tuple:
    """The mask step's ``(input, boolean, formula)``: the name of the scores it was given (``scaled``, or
    ``biased``, ``capped``, ``modified`` after a score mod), whether the mask is boolean, and its formula in
    ``lang`` naming them."""
    m = step.operands.get("mask")
    given = step.params.get("input", "scaled")
    boolean = m is not None and np.asarray(m).dtype == np.bool_
    return given, boolean, t("explain.f_masked" if boolean else "explain.f_masked_float", lang, input=given)


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
    :func:`qkv.explain.doc.fit`). Beyond MAX_TERMS terms the first three and a count (not a sum to check)."""
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
