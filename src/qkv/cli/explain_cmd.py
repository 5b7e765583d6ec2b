"""``qkv explain``, ``qkv examples`` and ``qkv check``: the hand calculation, step by step, and its checker."""
from __future__ import annotations

import json
import os
import sys

import click

from qkv import locales
from qkv.locales import t

from qkv.cli import UserError
from qkv.cli._app import cli

DEFAULT_EXAMPLE = "seed003"


class LangChoice(click.Choice):
    """``--lang``: one of the languages that have a locale file now (:func:`qkv.locales.langs`; a file added
    through ``QKV_LOCALES`` is a choice too)."""

    def __init__(self):
        super().__init__(())

    @property
    def choices(self):
        return locales.langs()

    @choices.setter
    def choices(self, value):
        pass


def lang_option(help_text: str = "Language (qkv.locales: en, zh, or a locale file of your own)."):
    return click.option("--lang", type=LangChoice(), default=locales.DEFAULT, show_default=True, help=help_text)


def _load(example: str | None, path: str | None, lang: str = "en"):
    from qkv.explain import examples as ex

    if example is not None and path is not None:
        raise UserError(t("cli.both", lang))
    if path is not None:
        if os.path.isdir(path):
            raise UserError(t("cli.folder", lang, path=path))
        if not os.path.exists(path):
            raise UserError(t("cli.no_file", lang, path=path))
        try:
            return ex.load_file(path)
        except OSError as exc:
            raise UserError(t("cli.cannot_read", lang, path=path, why=exc.strerror or exc)) from None
    name = DEFAULT_EXAMPLE if example is None else example
    names = ex.builtin_names()
    if name not in names:
        raise UserError(t("cli.unknown_example", lang, name=name, names=", ".join(names)))
    return _localized(ex.load_example(name), lang)


def _localized(worked, lang: str):
    """A built-in example with its title in ``lang`` (:data:`qkv.locales`); a file's title stays as written."""
    from qkv.explain import examples as ex

    got = ex.titles(worked)
    if got:
        worked.title = got.get(lang, worked.title)
    return worked


def _mask(spec: str | None, worked, lang: str = "en"):
    """--mask: causal, none, padding:N (keys N… are padding), window:N (causal sliding window of N keys)."""
    if spec is None:
        return None
    from qkv.core import masks

    s = spec.strip().lower()
    if s in ("causal", "none"):
        return s
    L, S = worked.n_queries, worked.n_keys
    kind, _, num = s.partition(":")
    if kind in ("padding", "window") and num:
        try:
            n = int(num)
        except ValueError:
            n = None
        if n is None or n < 1:
            raise UserError(t("cli.mask_number", lang, kind=kind, spec=spec))
        if kind == "padding":
            if n > S:
                raise UserError(t("cli.mask_padding", lang, n=n, S=S))
            return masks.padding([n], max_len=S).reshape(1, S).repeat(L, axis=0)       # (L, S)
        return masks.sliding_window(L, S, window=n, causal=True)
    raise UserError(t("cli.mask_kind", lang, spec=spec))


def _emit(text: str) -> None:
    click.echo(text, nl=not text.endswith("\n"))


@cli.command("explain")
@click.argument("file", required=False, type=click.Path(dir_okay=True))
@click.option("--example", "-e", metavar="NAME", help="A built-in example (qkv examples lists them; default seed003).")
@lang_option()
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]), default="text", show_default=True,
              help="Output format (rich tables on a terminal for text; plain text when piped).")
@click.option("--precision", type=click.IntRange(0, 12), default=4, show_default=True, help="Decimals shown.")
@click.option("--heads", type=click.IntRange(1, 1024), default=None,
              help="Number of heads, 1 … 1024 (split, per-head attention, concat, W_O); needs an example that starts "
                   "from X whose W_Q and W_V widths it divides (seed 003's 4×3 W_Q: --heads 3).")
@click.option("--mask", "mask_spec", metavar="causal|none|padding:N|window:N", default=None,
              help="Override the example's mask (True = may attend): causal, none, padding:N (only the first N "
                   "keys are real), window:N (causal, the last N keys).")
@click.option("--query", metavar="ROW", default=None,
              help="Explain only this query (its 0-based row or its token): q, q·k for every key, scaling, "
                   "softmax, weighted sum.")
@click.option("--head", type=click.IntRange(min=0), default=0, show_default=True, help="With --query: the head.")
@click.option("--ring", "ring_p", type=click.IntRange(1, 64), default=None, metavar="P",
              help="Instead: ring attention over P ranks (1 … 64), step by step — who holds which K/V block, the partial "
                   "outputs and log-sum-exps, the merge (qkv.distributed; default example: 8 positions, causal).")
@click.option("--layout", "ring_layout", type=click.Choice(["zigzag", "contiguous"]), default=None,
              help="With --ring: how the sequence is shared (default: zigzag where the length allows).")
def explain_cmd(file, example, lang, fmt, precision, heads, mask_spec, query, head, ring_p, ring_layout):
    """Explain attention step by step, as a textbook: every element's arithmetic for small inputs.

    With no argument: seed 003's example (我 爱 吃; X 3×4; W_Q, W_K, W_V 4×3). FILE is a worked-example
    file (YAML or JSON); --example NAME picks a built-in one.
    """
    from qkv.explain import doc as _doc, examples as ex
    from qkv.explain.render import build_doc, build_query_doc

    from qkv.explain.render import EDGE, SMALL

    if ring_layout is not None and ring_p is None:
        raise UserError(t("ring.layout_alone", lang))
    if ring_p is not None:                                   # qkv.distributed's ring, simulated and written out
        from qkv.integrations.distributed import default_worked, explain_ring
        for opt, given in (("--query", query is not None), ("--heads", heads is not None)):
            if given:
                raise UserError(t("ring.not_with", lang, opt=opt))
        worked = default_worked() if example is None and file is None else _load(example, file, lang)
        doc = explain_ring(worked, ring_p, layout=ring_layout, mask=_mask(mask_spec, worked, lang), lang=lang,
                             precision=precision)
        if fmt == "text" and sys.stdout.isatty():
            _doc.print_rich(doc, precision)
            return 0
        _emit(_doc.emit(doc, fmt, precision))
        return 0
    worked = _load(example, file, lang)
    mask = _mask(mask_spec, worked, lang)
    # A large input (issue 11): the attention part is computed in blocks of query rows and only the rows the
    # document shows are kept (examples.run_rows) — a 10,000-token file in ~200 MB instead of 13 GB.
    large = ex.is_large(worked, heads)
    row = None if query is None else _query_row(query, worked, lang)
    L = worked.n_queries
    if not large:
        trace = ex.run(worked, heads=heads, mask=mask)
    elif row is None:
        trace = ex.run_rows(worked, list(range(min(EDGE, L))) + list(range(max(L - EDGE, 0), L)), heads=heads,
                            mask=mask)
    else:
        trace = ex.run_rows(worked, [row], heads=heads, mask=mask)
    tokens = list(worked.tokens) if worked.tokens_given else None
    kv_tokens = list(worked.kv_tokens) if worked.kv_tokens_given else None
    if query is None:
        doc = build_doc(trace, lang=lang, precision=precision, tokens=tokens, kv_tokens=kv_tokens,
                        title=_title(worked, heads, lang))
        if L > SMALL or worked.n_keys > SMALL:         # tables elided: say how to see one query whole
            how = f"qkv explain {file if file is not None else '--example ' + (worked.name or '')}".rstrip()
            doc.intro.append(t("explain.large_note", lang, L=L, S=worked.n_keys, how=how))
    else:
        n_heads = trace["weights"].array.shape[-3] if trace["weights"].array.ndim >= 3 else 1
        if head >= n_heads:
            raise UserError(t("cli.bad_head", lang, last=n_heads - 1, head=head))
        doc = build_query_doc(trace, row, head=head, lang=lang, precision=precision, tokens=tokens,
                              kv_tokens=kv_tokens)
    if query is None and heads is None and mask_spec is None and worked.claims and not large:
        from qkv.explain import check

        r = check(worked)
        how = f"qkv check --example {worked.name}" if file is None else f"qkv check {file}"
        doc.intro.append(t("check.claims_note", lang, n=len(r.claims), how=how, **r.summary))
    if fmt == "text" and sys.stdout.isatty():
        _doc.print_rich(doc, precision)
        return 0
    _emit(_doc.emit(doc, fmt, precision))
    return 0


def _title(worked, heads, lang: str) -> str | None:
    """The example's title; with --heads N (other than the example's own) without what it said about its heads
    ("(self-attention, one head)") and with the N heads it is explained with."""
    import re

    title = worked.title
    if heads is None or heads == worked.heads:
        return title
    base = re.sub(r"\s*\([^()]*\bheads?\b[^()]*\)", "", title or "").strip() or (worked.name or "")
    return t("explain.title_heads", lang, title=base, h=heads)


def _query_row(query: str, worked, lang: str = "en") -> int:
    last = worked.n_queries - 1
    if worked.tokens_given and query in worked.tokens:
        if worked.tokens.count(query) > 1:
            raise UserError(t("cli.query_dup", lang, tok=query, k=worked.tokens.count(query)))
        return worked.tokens.index(query)
    try:
        row = int(query)
    except ValueError:
        if worked.tokens_given:
            raise UserError(t("cli.query_bad_labels", lang, tokens=worked.tokens, last=last, query=query)) from None
        raise UserError(t("cli.query_bad", lang, last=last, query=query)) from None
    if not 0 <= row < worked.n_queries:
        raise UserError(t("cli.query_range", lang, last=last, row=row))
    return row


@cli.command("examples")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@lang_option()
def examples_cmd(fmt, lang):
    """List the built-in worked examples (use one with qkv explain --example NAME)."""
    from qkv.explain import examples as ex

    rows = []
    for name in ex.builtin_names():
        w = _localized(ex.load_example(name), lang)
        first = {"X": "X", "QK": "Q", "scores": "scores"}[w.start]
        arr = getattr(w, first)
        start = f"{first} {arr.shape[0]}×{arr.shape[1]}"
        extras = [start]
        if w.heads > 1:
            extras.append(t("cli.ex_heads", lang, n=w.heads))
        if w.mask is not None:
            extras.append(t("cli.ex_causal", lang) if isinstance(w.mask, str) else t("cli.ex_mask", lang))
        if w.X_kv is not None:
            extras.append(t("cli.ex_cross", lang))
        if w.rope is not None:
            extras.append(t("cli.ex_rope", lang))
        if w.alibi is not None:
            extras.append(t("cli.ex_alibi", lang))
        if w.softcap is not None:
            extras.append(t("cli.ex_softcap", lang, c=f"{w.softcap:g}"))
        if w.window is not None:
            extras.append(t("cli.ex_window", lang, n=w.window))
        if w.prefix is not None:
            extras.append(t("cli.ex_prefix", lang, n=w.prefix))
        if w.documents is not None:
            extras.append(t("cli.ex_documents", lang))
        if w.sinks is not None:
            extras.append(t("cli.ex_sinks", lang, n=w.sinks))
        if w.sink_logits is not None:
            extras.append(t("cli.ex_sink_logits", lang))
        if w.claims:
            n = sum(len(r) for rows_ in w.claims.values() for r in rows_.values())
            extras.append(t("cli.ex_claims", lang, n=n))
        rows.append({"name": name, "title": w.title, "default": name == DEFAULT_EXAMPLE, "details": extras})
    if fmt == "json":
        _emit(json.dumps(rows, ensure_ascii=False, indent=2) + "\n")
        return 0
    width = max(len(r["name"]) for r in rows)
    lines = []
    for r in rows:
        mark = " " + t("cli.ex_default", lang) if r["default"] else ""
        lines.append(f"{r['name']:<{width}}  {r['title']}{mark}  [{', '.join(r['details'])}]")
    lines.append("")
    lines.append(t("cli.ex_footer", lang))
    _emit("\n".join(lines) + "\n")
    return 0


@cli.command("check")
@click.argument("file", required=False, type=click.Path(dir_okay=True))
@click.option("--example", "-e", metavar="NAME", help="Check a built-in example's claims instead of a FILE.")
@lang_option()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: root mistakes first; json: {ok, claims, summary}.")
@click.option("--precision", type=click.IntRange(0, 12), default=4, show_default=True,
              help="Decimals of the true values shown (text).")
def check_cmd(file, example, lang, fmt, precision):
    """Check a worked example's claimed numbers: correct, carried (inherited) or wrong (a root mistake).

    Exit code 0 when every claim is correct, 1 when any is carried or wrong, 2 when the file cannot be used.
    """
    from qkv.explain import doc as _doc, check

    if file is None and example is None:
        raise UserError(t("cli.check_nothing", lang))
    worked = _load(example, file, lang)
    report = check(worked)
    if fmt == "json":
        _emit(report.to_json())
    elif sys.stdout.isatty():
        _doc.print_rich(report.doc(lang, precision), precision)
    else:
        _emit(report.render(lang, "text", precision))
    return report.exit_code
