"""``qkv heatmap`` (matplotlib picture of attention weights) and ``qkv view`` (the offline interactive page)."""
from __future__ import annotations

import os

import click
import numpy as np

from . import UserError
from ._app import cli
from .explain_cmd import lang_option

#: The built-in example both commands start from when given nothing: seed 003's 我 爱 吃.
DEFAULT_EXAMPLE = "seed003"


class _TokensCommand(click.Command):
    """Lets ``--tokens a b c`` take every following word up to the next option (click options take one)."""

    def parse_args(self, ctx, args):
        out, i = [], 0
        while i < len(args):
            if args[i] == "--":
                out.extend(args[i:])
                break
            if args[i] == "--tokens":
                j = i + 1
                while j < len(args) and not (args[j].startswith("-") and len(args[j]) > 1):
                    out += ["--tokens", args[j]]
                    j += 1
                if j == i + 1:
                    raise click.UsageError("--tokens: expected one or more tokens after it", ctx=ctx)
                i = j
                continue
            out.append(args[i])
            i += 1
        return super().parse_args(ctx, out)


def _examples():
    try:
        from qkv.explain import examples
    except ImportError as exc:                                       # pragma: no cover - a broken install
        raise UserError(f"worked examples are unavailable: {exc}") from None
    return examples


def _load_worked(example: str | None, path: str | None):
    """The worked example named ``example``, or read from ``path``, or the default (seed 003)."""
    ex = _examples()
    if example is not None and path is not None:
        raise UserError("give either --example NAME or a FILE, not both")
    if path is not None:
        if not os.path.isfile(path):
            raise UserError(f"cannot read {path!r}: no such file")
        if not os.access(path, os.R_OK):
            raise UserError(f"cannot read {path!r}: permission denied")
        return ex.load_file(path)
    name = DEFAULT_EXAMPLE if example is None else example
    names = list(ex.builtin_names())
    if name not in names:
        raise UserError(f"unknown example {name!r}; the built-in examples are: {', '.join(names)}")
    return ex.load_example(name)


def _tokens(tokens, expected: int, what: str = "tokens"):
    if not tokens:
        return None
    tokens = list(tokens)
    if len(tokens) == 1 and len(tokens[0].split()) == expected and expected > 1:
        tokens = tokens[0].split()                                   # --tokens "a b c" as one word
    if len(tokens) != expected:
        raise UserError(f"--tokens: expected {expected} tokens ({what}), got {len(tokens)}")
    return tokens


def _check_output(path: str, suffixes: tuple[str, ...] | None) -> str:
    if suffixes is not None and os.path.splitext(path)[1].lower() not in suffixes:
        raise UserError(f"-o/--output: expected a file name ending in {', '.join(suffixes)}, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {path!r}: the folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise UserError(f"cannot write {path!r}: it is a folder")
    return path


def _write(writer, path: str) -> None:
    """Run ``writer(path)`` (an atomic writer: a temporary file renamed into place); any failure is one line and
    leaves no file behind."""
    try:
        writer(path)
    except OSError as exc:
        raise UserError(f"cannot write {path!r}: {exc.strerror or exc}") from None
    except MemoryError:
        raise UserError(f"cannot write {path!r}: out of memory while drawing it (nothing was written)") from None


def _load_model():
    try:
        from qkv.models import load_bert
    except ImportError as exc:
        raise UserError(f"--model needs the model extra: pip install 'qkv[model]' ({exc})") from None
    return load_bert()


# ---------------------------------------------------------------------------------------------- heatmap
@cli.command("heatmap", cls=_TokensCommand)
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--example", "-e", metavar="NAME", help="A built-in worked example (default: seed 003's 我 爱 吃).")
@click.option("--model", "-m", "model_text", metavar="TEXT", help="A sentence for the MiniLM model (model extra).")
@click.option("--layer", type=int, default=0, show_default=True, help="With --model: the layer (0-based).")
@click.option("--head", type=int, default=None, help="One head (0-based); default: all heads of a multi-head input.")
@click.option("--all-heads", is_flag=True, help="A grid with one heatmap per head.")
@click.option("--tokens", multiple=True, metavar="A B C", help="Token labels (one per query row).")
@click.option("--title", default=None, help="The picture's title.")
@click.option("--annotate/--no-annotate", default=None, help="Write the values in the cells (default: when small).")
@click.option("-o", "--output", default="attention.png", show_default=True, metavar="FILE",
              help="Output file; .png, .svg or .pdf picks the format.")
def heatmap_cmd(file, example, model_text, layer, head, all_heads, tokens, title, annotate, output):
    """Draw attention weights as a heatmap (PNG, SVG or PDF by the suffix of -o).

    With no argument: seed 003's example (我 爱 吃). FILE is a worked-example file. With --model TEXT:
    the attention of one --layer of the MiniLM model, all its heads in a grid or one --head.
    """
    from qkv import viz

    _check_output(output, (".png", ".svg", ".pdf"))
    if head is not None and all_heads:
        raise UserError("give either --head H or --all-heads, not both")
    if model_text is not None:
        if file is not None or example is not None:
            raise UserError("give either --model TEXT or an example (--example NAME / FILE), not both")
        if not model_text.strip():
            raise UserError("--model: expected a non-empty sentence")
        model = _load_model()
        n_layers = model.config.num_layers
        if not 0 <= layer < n_layers:
            raise UserError(f"--layer: expected 0 … {n_layers - 1}, got {layer}")
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.run([model_text])                                 # one layer kept, float32: bounded
        for w in caught:                                                  # e.g. truncated to 512 tokens
            click.echo(f"qkv: warning: {' '.join(str(w.message).split())}", err=True)
        model_tokens = [str(t) for t in out.tokens[0]]
        T = len(model_tokens)
        weights = np.asarray(out.attentions[layer])[0, :, :T, :T]         # (H, T, T)
        del out
        rows = cols = _tokens(tokens, T, "one per model token") or model_tokens
        default_title = f"{viz.model_name(model)}: layer {layer}"
    else:
        worked = _load_worked(example, file)
        trace = _examples().run(worked)
        weights = np.asarray(trace["weights"].array)
        while weights.ndim > 3 and weights.shape[0] == 1:
            weights = weights[0]                                          # (H, L, S) or (L, S)
        rows = _tokens(tokens, weights.shape[-2], "one per query row") or list(worked.tokens)
        cols = list(worked.kv_tokens) if getattr(worked, "kv_tokens", None) else (
            rows if weights.shape[-1] == weights.shape[-2] else list(worked.tokens))
        default_title = worked.title
    if weights.ndim == 3 and weights.shape[0] == 1 and not all_heads:
        weights = weights[0]
    if weights.ndim == 3:
        H = weights.shape[0]
        if head is not None:
            if not 0 <= head < H:
                raise UserError(f"--head: expected 0 … {H - 1}, got {head}")
            weights = weights[head]
            default_title = f"{default_title}, head {head}"
    elif head not in (None, 0):
        raise UserError(f"--head: this input has one head (0), got {head}")
    if weights.ndim == 3:
        fig = viz.heads_grid(weights, rows, cols, suptitle=title or default_title, annotate=annotate)
    else:
        fig = viz.heatmap(weights, rows, cols, title=title or default_title, annotate=annotate).figure
    _write(lambda p: viz.save(fig, p), output)
    click.echo(f"wrote {output}")


# ---------------------------------------------------------------------------------------------- view
@cli.command("view", cls=_TokensCommand)
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--example", "-e", metavar="NAME", help="Start the playground from a built-in worked example.")
@click.option("--tokens", multiple=True, metavar="A B C", help="Token labels of the playground (one per row of X).")
@click.option("--model", "-m", "model_text", metavar="TEXT", help="Add the model view for this sentence (model extra).")
@click.option("-o", "--output", default="attention.html", show_default=True, metavar="FILE", help="The HTML file.")
@lang_option("Language of the page (qkv.locales).")
def view_cmd(file, example, tokens, model_text, output, lang):
    """Write one self-contained HTML page (no network access; open it from disk, offline).

    The playground starts from seed 003's example, --example NAME or FILE: edit tokens, X, W_Q, W_K and W_V
    and everything is recomputed; hover a cell for its arithmetic; toggle the causal mask, the √d_k scaling,
    the number of heads. With --model TEXT the page also shows every layer and head of the MiniLM model.
    """
    from qkv import viz

    _check_output(output, (".html", ".htm"))
    worked = _load_worked(example, file)
    playground = viz.from_worked(worked, tokens=_tokens(tokens, len(worked.tokens), "one per row of X"))
    model = viz.model_data(model_text, model=_load_model()) if model_text is not None else None
    _write(lambda p: viz.write_page(p, {"playground": playground, "model": model}, lang=lang), output)
    click.echo(f"wrote {output}")
