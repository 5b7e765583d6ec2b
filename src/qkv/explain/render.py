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

The document is built in parts: :mod:`qkv.explain._layout` (labels, slices, row-sampled steps, elided tables),
:mod:`qkv.explain._arith` (the written-out arithmetic lines), :mod:`qkv.explain._builder` (a section per step of
the whole trace) and :mod:`qkv.explain._query` (the sections of one query's document).
"""
from __future__ import annotations

from qkv.core.tracing import Trace
from qkv.explain import doc as _doc
from qkv.explain._builder import _Builder
from qkv.explain._layout import EDGE, SMALL, _check_common, _Labels, full_shape
from qkv.explain._query import build_query_doc
from qkv.explain.doc import Doc
from qkv.locales import t

__all__ = ["EDGE", "SMALL", "build_doc", "build_query_doc", "explain_query", "full_shape", "render"]



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
