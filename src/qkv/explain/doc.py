"""A small document model (sections of text, tables and arithmetic) and its writers: text, markdown, JSON, rich.

The explainer and the checker build a :class:`Doc`; each output format is one writer of it, so the formats
always say the same thing.
"""
from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, field

from qkv.locales import t

FORMATS = ("text", "markdown", "json")
MINUS = "\u2212"


# ----------------------------------------------------------------------------------------------- numbers
def fmt(x, precision: int = 4) -> str:
    """A number for people: rounded to ``precision`` decimals, trailing zeros dropped but one kept
    (``0.39``, ``1.0``, ``−0.5``); ``−∞`` for a masked score; tiny non-zero values in scientific notation."""
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return ("−∞" if x < 0 else "∞")
    if x == 0:
        return "0"
    if precision >= 2 and abs(x) < 0.5 * 10.0 ** (-precision):
        s = f"{x:.{max(precision - 2, 1)}e}"
        mant, exp = s.split("e")
        mant = mant.rstrip("0").rstrip(".") if "." in mant else mant
        return (mant + "e" + str(int(exp))).replace("-", MINUS)
    s = f"{x:.{precision}f}"
    if "." in s:
        s = s.rstrip("0")
        if s.endswith("."):
            s += "0"
    if s in ("-0.0", "0.0", "-0"):
        s = "0"
    return s.replace("-", MINUS)


def fmt_factor(x, precision: int = 4) -> str:
    """A factor in a product: negative numbers in parentheses, ``(−0.5)``."""
    s = fmt(x, precision)
    return f"({s})" if s.startswith(MINUS) else s


def json_number(x, dtype=None):
    """A finite number for JSON (None for ±∞/NaN), as the shortest text that reads back to the same value of the
    array's ``dtype``: a float32 0.1 is written 0.1, not 0.10000000149011612 (JSON's own float repr already
    gives the shortest float64 text)."""
    x = float(x)
    if not math.isfinite(x):
        return None
    if dtype is not None and str(dtype) in ("float32", "float16"):
        import numpy as np

        return float(str(getattr(np, str(dtype))(x)))          # numpy's shortest round-trip text for that type
    return x


# ----------------------------------------------------------------------------------------------- lines that add up
#: The operands of a written-out line get up to this many decimals more than asked before the line is marked ≈.
MAX_EXTRA_DECIMALS = 3


def shown(text: str):
    """The exact number a formatted number shows (``fmt``/``fmt_factor`` output: "(−0.5)", "4.39e−5"), as a
    Decimal; None for ∞ or NaN."""
    from decimal import Decimal, InvalidOperation

    s = text.strip()
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1]
    s = s.replace(MINUS, "-")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


class Line:
    """One written-out line: its operands shown with ``q`` decimals (``n``; ``f`` as a factor, negative numbers in
    parentheses), its results with ``p`` (the precision asked). ``rel(exact, value)`` writes ``= value`` and
    records whether the line adds up there: ``exact`` (the result of the operands as shown, computed exactly)
    lies within half a unit of the last shown decimal of ``value`` — the shown value is its only correct
    rounding (an exact half, 1 / 2 shown as 0 or 1, is not). ``at=q`` for an intermediate result that the next
    relation uses as an operand. With ``approx`` a relation that does not add up is written ``≈``."""

    def __init__(self, q: int, p: int | None = None, approx: bool = False):
        self.q, self.p, self.approx, self.ok = q, q if p is None else p, approx, True

    def n(self, x) -> str:
        return fmt(x, self.q)

    def f(self, x) -> str:
        return fmt_factor(x, self.q)

    def rel(self, exact, value, at: int | None = None) -> str:
        from decimal import Decimal

        digits = self.p if at is None else at
        shown_value = fmt(value, digits)
        sv = shown(shown_value)
        good = False
        if exact is not None and sv is not None:
            try:
                exact = exact if isinstance(exact, Decimal) else Decimal(repr(float(exact)))
                unit = Decimal(1).scaleb(min(-digits, sv.as_tuple().exponent))
                good = abs(exact - sv) < unit / 2          # the shown value is the only correct rounding
            except (ArithmeticError, ValueError, OverflowError):
                good = False
        self.ok = self.ok and good
        return ("≈ " if (self.approx and not good) else "= ") + shown_value


def fit(precision: int, build) -> str:
    """``build(Line)`` → text, with the operands at the fewest decimals (``precision`` … ``precision`` +
    MAX_EXTRA_DECIMALS, at most 12) at which every relation adds up, the results at ``precision``; else all at
    ``precision`` with the relations that do not add up marked ≈. So ``--precision 0`` writes
    ``Q[我, 1] = 1.2×0.2 + 0.8×0.5 + (−0.5)×0.8 + 0.3×1.1 = 1`` (0.57, rounded), never
    ``1×0 + 1×0 + 0×1 + 0×1 = 1``."""
    for q in range(precision, min(12, precision + MAX_EXTRA_DECIMALS) + 1):
        ln = Line(q, precision)
        text = build(ln)
        if ln.ok:
            return text
    return build(Line(precision, precision, approx=True))


# ----------------------------------------------------------------------------------------------- model
@dataclass
class Table:
    name: str
    rows: list[str]
    cols: list[str]
    values: list[list]                  # floats (−inf allowed), or bools when kind == "bool"
    kind: str = "num"
    note: str | None = None
    dtype: str | None = None            # the array's dtype (JSON writes a float32's shortest float32 text)


@dataclass
class Section:
    step: str
    title: str
    formula: str | None = None
    shape: str | None = None
    items: list = field(default_factory=list)        # ("text", str) | ("table", Table) | ("calc", [str])

    def text(self, s: str) -> "Section":
        self.items.append(("text", s))
        return self

    def table(self, tb: Table) -> "Section":
        self.items.append(("table", tb))
        return self

    def calc(self, lines: list[str]) -> "Section":
        if lines:
            self.items.append(("calc", list(lines)))
        return self


@dataclass
class Doc:
    title: str
    lang: str
    intro: list[str] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    extra: dict = field(default_factory=dict)       # merged into the JSON (e.g. the check report's fields)


# ----------------------------------------------------------------------------------------------- text
def width(s: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in s)


def pad(s: str, w: int, right: bool) -> str:
    gap = " " * max(w - width(s), 0)
    return gap + s if right else s + gap


def _cell(v, kind: str, precision: int) -> str:
    if v is None:
        return "…"
    if kind == "bool":
        return "✓" if v else "✗"
    if isinstance(v, str):
        return v
    return fmt(v, precision)


def _table_text(tb: Table, precision: int, indent: str = "  ") -> list[str]:
    head = [tb.name] + list(tb.cols)
    body = [[r] + [_cell(v, tb.kind, precision) for v in row] for r, row in zip(tb.rows, tb.values)]
    widths = [max(width(row[c]) for row in [head] + body) for c in range(len(head))]
    out = []
    for k, row in enumerate([head] + body):
        cells = [pad(row[0], widths[0], False)] + [pad(c, widths[i + 1], True) for i, c in enumerate(row[1:])]
        out.append(indent + "  ".join(cells).rstrip())
    if tb.note:
        out.append(indent + f"({tb.note})")
    return out


def to_text(doc: Doc, precision: int = 4) -> str:
    lines = [doc.title, "=" * min(max(width(doc.title), 10), 100)]
    lines += doc.intro
    for sec in doc.sections:
        lines.append("")
        head = sec.title + (f"    [{sec.shape}]" if sec.shape else "")
        lines.append(head)
        lines.append("-" * min(max(width(head), 10), 100))
        if sec.formula and sec.formula not in sec.title:
            lines.append("  " + sec.formula)
        for kind, item in sec.items:
            if kind == "text":
                lines.append("  " + item)
            elif kind == "table":
                lines += _table_text(item, precision)
            else:
                lines += ["    " + ln for ln in item]
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------- markdown
def _md_escape(s: str) -> str:
    return (s.replace("&", "&amp;").replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")
            .replace("<", "&lt;").replace(">", "&gt;"))


def _table_md(tb: Table, precision: int) -> list[str]:
    head = [tb.name] + list(tb.cols)
    out = ["| " + " | ".join(_md_escape(h) for h in head) + " |",
           "|" + "|".join(["---"] + ["---:"] * len(tb.cols)) + "|"]
    for r, row in zip(tb.rows, tb.values):
        out.append("| " + " | ".join([_md_escape(r)] + [_cell(v, tb.kind, precision) for v in row]) + " |")
    if tb.note:
        out.append("")
        out.append(f"*{_md_escape(tb.note)}*")
    return out


def to_markdown(doc: Doc, precision: int = 4) -> str:
    lines = [f"# {_md_escape(doc.title)}", ""]
    for s in doc.intro:
        lines += [_md_escape(s), ""]
    for sec in doc.sections:
        lines.append(f"## {_md_escape(sec.title)}")
        lines.append("")
        if sec.shape:
            lines += [f"{t('explain.shape', doc.lang)}: `{sec.shape}`", ""]
        if sec.formula and sec.formula not in sec.title:
            lines += [f"`{sec.formula}`", ""]
        for kind, item in sec.items:
            if kind == "text":
                lines += [_md_escape(item), ""]
            elif kind == "table":
                lines += _table_md(item, precision) + [""]
            else:
                lines += ["```"] + item + ["```", ""]
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------- JSON
def _table_json(tb: Table) -> dict:
    vals = [[(bool(v) if tb.kind == "bool" else (None if v is None else
              (v if isinstance(v, str) else json_number(v, tb.dtype)))) for v in row] for row in tb.values]
    return {"type": "table", "name": tb.name, "rows": list(tb.rows), "cols": list(tb.cols), "kind": tb.kind,
            "values": vals, "note": tb.note}


def to_json_obj(doc: Doc) -> dict:
    secs = []
    for sec in doc.sections:
        items = []
        for kind, item in sec.items:
            if kind == "text":
                items.append({"type": "text", "text": item})
            elif kind == "table":
                items.append(_table_json(item))
            else:
                items.append({"type": "calc", "lines": list(item)})
        secs.append({"step": sec.step, "title": sec.title, "formula": sec.formula, "shape": sec.shape,
                     "items": items})
    obj = {"title": doc.title, "lang": doc.lang, "intro": list(doc.intro), "sections": secs}
    obj.update(doc.extra)
    return obj


def to_json(doc: Doc) -> str:
    return json.dumps(to_json_obj(doc), ensure_ascii=False, indent=2, allow_nan=False) + "\n"


def emit(doc: Doc, fmt_name: str, precision: int) -> str:
    if fmt_name == "text":
        return to_text(doc, precision)
    if fmt_name == "markdown":
        return to_markdown(doc, precision)
    return to_json(doc)


# ----------------------------------------------------------------------------------------------- rich
def print_rich(doc: Doc, precision: int = 4, console=None) -> None:
    """Print the document with rich: headings, coloured tables (for a terminal)."""
    from rich import box
    from rich.console import Console
    from rich.rule import Rule
    from rich.table import Table as RTable
    from rich.text import Text

    console = console or Console()
    console.print(Text(doc.title, style="bold cyan"))
    for s in doc.intro:
        console.print(Text(s, style="italic"))
    for sec in doc.sections:
        console.print()
        title = Text(sec.title, style="bold yellow")
        if sec.shape:
            title.append(f"   {sec.shape}", style="dim")
        console.print(Rule(title, align="left", style="yellow"))
        if sec.formula and sec.formula not in sec.title:
            console.print(Text("  " + sec.formula, style="bold"))
        for kind, item in sec.items:
            if kind == "text":
                console.print(Text("  " + item))
            elif kind == "table":
                tb = RTable(box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=True, header_style="bold magenta")
                tb.add_column(item.name, style="bold green", justify="left")
                for c in item.cols:
                    tb.add_column(c, justify="right")
                for r, row in zip(item.rows, item.values):
                    cells = []
                    for v in row:
                        c = _cell(v, item.kind, precision)
                        style = "red" if c in ("−∞", "✗") else ("green" if c == "✓" else "")
                        cells.append(Text(c, style=style))
                    tb.add_row(r, *cells)
                console.print(tb)
                if item.note:
                    console.print(Text(f"  ({item.note})", style="dim"))
            else:
                for ln in item:
                    console.print(Text("    " + ln, style="cyan"))
