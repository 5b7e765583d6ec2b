"""``qkv lab scale|mask|heads|train``: the seeds' claims shown by experiment (:mod:`qkv.lab`).

Each prints a table (rich on a terminal, plain text when piped) and a paragraph in ``--lang``; ``--json``
prints the experiment's data instead (exactly what ``qkv.lab.NAME(...)`` returns); ``--plot FILE`` also
draws it (``viz`` extra; .png, .svg or .pdf, written atomically).
"""
from __future__ import annotations

import functools
import json
import os
import sys

import click

from qkv._files import output_kind
from qkv.tools.lab import common as C
from qkv.locales import t

from qkv.cli import UserError
from qkv.cli._app import cli
from qkv.cli._progress import progress_bar
from qkv.cli.explain_cmd import lang_option

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


@cli.group("lab")
def lab_group():
    """Experiments that show why attention works, on qkv's own forward and backward.

    scale: ÷√d_k; mask: −∞ before softmax vs zeroing after; heads: one head vs two; train: a pronoun learns
    to find its noun (它 → 树).
    """


def _common(fn):
    """--seed, --json, --plot FILE, --lang for every experiment."""
    @click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="The random seed.")
    @click.option("--json", "as_json", is_flag=True, help="Print the experiment's data as JSON (for scripts).")
    @click.option("--plot", "plot_path", metavar="FILE", default=None,
                  help="Also draw the result to FILE (.png, .svg or .pdf; needs the viz extra).")
    @lang_option("Language of the table and the paragraph (qkv.locales).")
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        return fn(*args, **kw)
    return wrapper


def _check_plot(path: str | None, lang: str, as_json: bool = False) -> None:
    """Before any work: a plot needs matplotlib, a known suffix and an existing folder (one line, exit 2)."""
    if path is None:
        return
    from qkv.tools.lab.common import matplotlib_available

    if output_kind(path) != "file":                       # -, a pipe or a device: written to directly, as PNG
        if path == "-" and as_json:
            raise UserError(t("lab.plot_stdout_json", lang))
        if not matplotlib_available():
            raise UserError(t("lab.needs_viz", lang))
        return
    if os.path.isdir(path):
        raise UserError(t("lab.plot_is_folder", lang, path=path))
    if os.path.splitext(path)[1].lower() not in PLOT_SUFFIXES:
        raise UserError(t("lab.plot_suffix", lang, path=path, suffixes=", ".join(PLOT_SUFFIXES)))
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(t("lab.plot_folder", lang, path=path, folder=folder))
    if not matplotlib_available():
        raise UserError(t("lab.needs_viz", lang))


def _plain_table(title: str, heads: list[str], rows: list[list[str]]) -> str:
    from qkv.explain.doc import pad, width

    widths = [max(width(str(r[i])) for r in [heads] + rows) for i in range(len(heads))]
    line = lambda cells: "  ".join(pad(str(c), w, i > 0) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [title, "=" * width(title), line(heads), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(s.rstrip() for s in out)


def _show(name: str, result: dict, lang: str, as_json: bool, plot_path: str | None, after=None) -> int:
    from qkv.tools import lab

    if plot_path is not None:
        from qkv.viz import plot_lab
        try:
            plot_lab(name, result, plot_path, lang)
        except OSError as exc:
            raise UserError(t("lab.cannot_write", lang, path=plot_path, why=exc.strerror or exc)) from None
        if plot_path == "-":                                  # standard output carried the picture: nothing else
            return 0
    if as_json:
        click.echo(json.dumps(result, ensure_ascii=False, indent=1))
        if plot_path is not None:
            click.echo(t("lab.wrote", lang, path=plot_path), err=True)       # stdout stays pure JSON
        return 0
    title, heads, rows = lab.table(name, result, lang)
    text = lab.paragraph(name, result, lang)
    if sys.stdout.isatty():
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        console = Console()
        tb = Table(title=title, box=box.SIMPLE_HEAVY, header_style="bold magenta", title_style="bold cyan")
        for i, h in enumerate(heads):
            tb.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            tb.add_row(*r)
        console.print(tb)
        console.print(Text(text))
    else:
        click.echo(_plain_table(title, heads, rows))
        click.echo("")
        click.echo(text)
    if after is not None:
        after()
    if plot_path is not None:
        click.echo(t("lab.wrote", lang, path=plot_path))
    return 0


@lab_group.command("scale")
@_common
@click.option("--samples", type=click.IntRange(16, C.MAX_SAMPLES), default=16384, show_default=True,
              help="Query rows per d_k (each against --keys keys; --samples × --keys at most 8,388,608).")
@click.option("--keys", type=click.IntRange(2, C.MAX_KEYS), default=16, show_default=True,
              help="Keys per query row.")
def scale_cmd(seed, as_json, plot_path, lang, samples, keys):
    """÷√d_k: the variance of q·k, softmax saturation and the scores' gradient, with and without scaling,
    for d_k = 4 … 1024."""
    from qkv.tools import lab

    _check_plot(plot_path, lang, as_json)
    rows = len(lab.D_KS) * -(-samples // keys) * keys
    with progress_bar("lab scale", rows, "row") as bar:
        result = lab.scale(seed=seed, samples=samples, keys=keys, progress=bar)
    return _show("scale", result, lang, as_json, plot_path)


@lab_group.command("mask")
@_common
def mask_cmd(seed, as_json, plot_path, lang):
    """−∞ before softmax vs zeroing after, −1e9 and −1e4 in float16, on a padded batch with fully masked rows."""
    from qkv.tools import lab

    _check_plot(plot_path, lang, as_json)
    return _show("mask", lab.mask(seed=seed), lang, as_json, plot_path)


@lab_group.command("heads")
@_common
@click.option("--steps", type=click.IntRange(1, C.MAX_STEPS), default=400, show_default=True,
              help="Training steps.")
@click.option("--runs", type=click.IntRange(1, C.MAX_RUNS), default=3, show_default=True,
              help="Trainings per model (seeds SEED, SEED+1, …); the accuracy is their mean.")
def heads_cmd(seed, as_json, plot_path, lang, steps, runs):
    """One head vs two heads of the same total width, on a task that needs two relations at once (the previous
    token and the matching bracket)."""
    from qkv.tools import lab

    _check_plot(plot_path, lang, as_json)
    with progress_bar("lab heads", 2 * runs * (steps + 1), "step") as bar:
        result = lab.heads(seed=seed, steps=steps, runs=runs, progress=bar)
    return _show("heads", result, lang, as_json, plot_path)


@lab_group.command("train")
@_common
@click.option("--steps", type=click.IntRange(1, C.MAX_STEPS), default=400, show_default=True,
              help="Training steps.")
@click.option("--batch", type=click.IntRange(1, C.MAX_BATCH), default=128, show_default=True,
              help="Sentences per step.")
@click.option("--explain", "explain", is_flag=True,
              help="Also print qkv explain's calculation for 它 on 银行旁边有一棵树，它很高 with the learned "
                   "W_Q, W_K, W_V.")
def train_cmd(seed, as_json, plot_path, lang, steps, batch, explain):
    """A tiny attention model learns, in NumPy with qkv's backward, that a pronoun (它/他/她) attends to the
    noun it agrees with; then qkv explain shows 它's q matching 树's k."""
    from qkv.tools import lab

    _check_plot(plot_path, lang, as_json)
    with progress_bar("lab train", steps + 1, "step") as bar:
        result = lab.train(seed=seed, steps=steps, batch=batch, progress=bar)

    def after():
        click.echo("")
        if sys.stdout.isatty():
            from qkv.explain import doc as _doc
            from qkv.explain.render import build_query_doc
            from qkv.tools.lab import explain_trace

            w, trace = explain_trace(result["worked_example"])
            doc = build_query_doc(trace, w.tokens.index("它"), lang=lang, tokens=w.tokens)
            _doc.print_rich(doc, 4)
        else:
            click.echo(lab.explain_train(result, lang).rstrip("\n"))

    return _show("train", result, lang, as_json, plot_path, after if explain else None)
