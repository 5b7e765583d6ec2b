"""``qkv heatmap`` (matplotlib picture of attention weights) and ``qkv view`` (the offline interactive page)."""
from __future__ import annotations

import os

import click

from qkv._files import output_kind
from qkv.locales import t

from qkv.cli import UserError, _model_weights
from qkv.cli._app import cli
from qkv.cli._model_option import check_model, model_option
from qkv.cli.explain_cmd import lang_option
from qkv.cli.generate_cmd import OPTIONS as GENERATE_OPTIONS

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


def _load_worked(example: str | None, path: str | None, lang: str = "en"):
    """The worked example named ``example``, or read from ``path``, or the default (seed 003); its errors in
    ``lang``, as qkv explain says them."""
    from qkv.cli.explain_cmd import _load
    return _load(example, path, lang)


def _tokens(tokens, expected: int, what: str = "tokens"):
    if not tokens:
        return None
    tokens = list(tokens)
    last = tokens[-1]
    if len(tokens) > 1 and (os.path.isfile(last) or last.lower().endswith((".yaml", ".yml", ".json"))):
        # --tokens takes every word up to the next option: `--tokens a b c FILE` made FILE a token
        raise UserError(f"--tokens: its last word {last!r} looks like the example FILE (--tokens takes every word "
                        f"up to the next option); put FILE before it: … {last} --tokens {' '.join(tokens[:-1])}")
    if len(tokens) == 1 and len(tokens[0].split()) == expected and expected > 1:
        tokens = tokens[0].split()                                   # --tokens "a b c" as one word
    if len(tokens) != expected:
        raise UserError(f"--tokens: expected {expected} tokens ({what}), got {len(tokens)}")
    return tokens


def _check_output(path: str, suffixes: tuple[str, ...] | None) -> str:
    """-o FILE before any work: a name with one of ``suffixes`` in an existing folder — or ``-`` (standard output),
    a FIFO or a device, written to directly (:func:`qkv._files.output_kind`)."""
    if output_kind(path) != "file":
        return path
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


# ---------------------------------------------------------------------------------------------- heatmap
@cli.command("heatmap", cls=_TokensCommand)
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--example", "-e", metavar="NAME", help="A built-in worked example (default: seed 003's 我 爱 吃).")
@model_option(None, help_text="With --text: the model that reads it, minilm (all-MiniLM-L6-v2, the default; "
                              "model extra) or smollm2 (SmolLM2-135M-Instruct; llama extra).")
@click.option("--text", "text", metavar="TEXT", help="A text: draw one --layer of --model's attention over it.")
@click.option("--layer", type=int, default=0, show_default=True, help="With --text: the layer (0-based).")
@click.option("--head", type=int, default=None, help="One head (0-based); default: all heads of a multi-head input.")
@click.option("--all-heads", is_flag=True, help="A grid with one heatmap per head.")
@click.option("--tokens", multiple=True, metavar="A B C", help="Token labels (one per query row).")
@click.option("--title", default=None, help="The picture's title.")
@click.option("--annotate/--no-annotate", default=None, help="Write the values in the cells (default: when small).")
@click.option("-o", "--output", default="attention.png", show_default=True, metavar="FILE",
              help="Output file; .png, .svg or .pdf picks the format.")
def heatmap_cmd(file, example, model_name, text, layer, head, all_heads, tokens, title, annotate, output):
    """Draw attention weights as a heatmap (PNG, SVG or PDF by the suffix of -o).

    With no argument: seed 003's example (我 爱 吃). FILE is a worked-example file. With --text TEXT: the
    attention of one --layer of a model (--model minilm, the default, or smollm2), all its heads in a grid or
    one --head.
    """
    from qkv import viz

    _check_output(output, (".png", ".svg", ".pdf"))
    if head is not None and all_heads:
        raise UserError("give either --head H or --all-heads, not both")
    if model_name is not None or text is not None:
        if file is not None or example is not None:
            raise UserError("give either --text TEXT (a model's attention) or an example (--example NAME / FILE), "
                            "not both")
        name = check_model(model_name or "minilm", "qkv heatmap", text_option="--text TEXT")
        if text is None:
            raise UserError(t("cli.model_needs_text", "en", name=name, option="--text TEXT"))
        weights, model_tokens, model = _model_weights.layer_weights(name, text, layer)
        rows = cols = _tokens(tokens, len(model_tokens), "one per model token") or model_tokens
        default_title = f"{viz.model_name(model)}: layer {layer}"
    else:
        worked = _load_worked(example, file)
        from qkv.explain.weights import attention_weights
        weights = attention_weights(worked)                               # a large one: float32, by row blocks
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
    if output != "-":                                     # (standard output carried the output itself)
        click.echo(f"wrote {output}")


# ---------------------------------------------------------------------------------------------- view
def _note(key: str, lang: str, args: dict) -> None:
    from qkv.locales import t

    click.echo(f"qkv: note: {' '.join(t(key, lang, **args).split())}", err=True)


def _model_view_data(viz, name: str, text: str, lang: str, model=None):
    """The model view of ``text`` for ``name`` (minilm, smollm2) or a loaded ``model`` (``--hf DIR``); one-line
    errors for the page's limits."""
    import warnings

    if not text.strip():
        raise UserError("--text: expected a non-empty sentence")
    model = model if model is not None else _model_weights.load(name, lang)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            data = viz.model_data(text, model=model)
        except ValueError as exc:                                  # PageTooLarge, a text over the context
            raise UserError(str(exc)) from None
    for w in caught:                                               # e.g. MiniLM: truncated to 512 tokens
        click.echo(f"qkv: warning: {' '.join(str(w.message).split())}", err=True)
    return data


def _check_hf(text, prompt, compare_dir) -> None:
    """``--hf DIR`` reads --text or continues --generate (not with --model); ``--compare DIR`` needs --hf and
    --text."""
    if compare_dir is not None:
        if prompt is not None:
            raise UserError("give either --generate PROMPT or --compare DIR, not both")
        if text is None:
            raise UserError("--compare DIR: give the text with --text TEXT")
    _model_weights.check_hf_alone()
    if prompt is not None and text is not None:
        raise UserError("give either --text TEXT or --generate PROMPT, not both")
    if text is None and prompt is None:
        raise UserError("--hf DIR: give the text with --text TEXT (or --generate PROMPT for a decoder)")


def _load_compare(path):
    """The ``--compare`` folder, loaded as --hf's is; its errors name --compare."""
    try:
        return _model_weights.load_hf(path)
    except UserError as exc:
        msg = str(exc)
        raise UserError("--compare" + msg[len("--hf"):] if msg.startswith("--hf") else msg) from None


def _compare_view_data(model, path, text: str) -> dict:
    """The page's comparison of ``model`` (--hf) with the folder ``path`` (--compare) on ``text``."""
    from qkv.viz.page_hf import compare_data

    if not text.strip():
        raise UserError("--text: expected a non-empty sentence")
    other = _load_compare(path)
    try:
        return compare_data(model, other, text)
    except ValueError as exc:                                      # another architecture, the page's limits
        msg = " ".join(str(exc).split()).replace("a's architecture", "--hf's architecture")
        raise UserError("--compare: " + msg[len("b: "):] if msg.startswith("b: ") else msg) from None


def generation_rows(model, prompt: str, **options) -> dict:
    """The generation view of a transformers folder (--hf DIR --generate PROMPT): a decoder's only."""
    from qkv.viz.page_hf import hf_generation_data

    from qkv.cli.generate_cmd import option_error

    if not model.config.decoder:
        raise UserError(f"--generate: needs a causal language model; {model.config.name} is an encoder "
                        f"({model.config.model_type or 'not …ForCausalLM'}): it does not generate")
    try:
        return hf_generation_data(model, prompt, **options)
    except (ValueError, TypeError) as exc:                         # -n over the context, the chat template, limits
        raise option_error(exc, _VIEW_OPTIONS) from None


def _view_model(model_name, text, prompt, lang: str) -> str | None:
    """The model ``qkv view`` runs (None: none): ``--model`` names it (minilm for --text, smollm2 for
    --generate by default); a --model with neither --text nor --generate is an error, not a text."""
    if prompt is not None and text is not None:
        raise UserError("give either --text TEXT or --generate PROMPT, not both")
    if model_name is None and text is None and prompt is None:
        return None
    default = "smollm2" if prompt is not None else "minilm"
    name = check_model(model_name or default, "qkv view", lang=lang, text_option="--text TEXT")
    if prompt is not None and name != "smollm2":
        raise UserError("--generate: needs a decoder, --model smollm2 (MiniLM is an encoder: it does not "
                        "generate)")
    if text is None and prompt is None:
        if name == "smollm2":
            raise UserError(t("cli.model_needs_text_or_prompt", lang, name=name))
        raise UserError(t("cli.model_needs_text", lang, name=name, option="--text TEXT"))
    return name


#: view's names for the arguments of the generation (qkv.viz.generation_data, LlamaModel.generate): generate's,
#: with the prompt given by --generate.
_VIEW_OPTIONS = dict(GENERATE_OPTIONS, prompt="--generate")


@cli.command("view", cls=_TokensCommand)
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--example", "-e", metavar="NAME", help="Start the playground from a built-in worked example.")
@click.option("--tokens", multiple=True, metavar="A B C", help="Token labels of the playground (one per row of X).")
@model_option(None, help_text="The model that reads --text (minilm, the default, or smollm2) or continues "
                              "--generate (smollm2).")
@click.option("--text", "text", metavar="TEXT", help="Add the model view of TEXT: every layer and head of --model "
                                                      "(minilm, the default, or smollm2).")
@click.option("--generate", "prompt", metavar="PROMPT",
              help="The generation view: --model smollm2 continues PROMPT; step through the new tokens.")
@click.option("--max-new-tokens", "-n", type=int, default=32, show_default=True,
              help="With --generate: at most what the model's context leaves after the prompt.")
@click.option("--temperature", "-T", type=float, default=0.0, show_default=True,
              help="With --generate: 0 greedy, > 0 sampling.")
@click.option("--seed", type=int, default=None, help="With --generate: the sampling's seed.")
@click.option("--chat", is_flag=True, help="With --generate: wrap the prompt in the chat template.")
@click.option("--why/--no-why", default=True, show_default=True,
              help="With a worked example (the playground): the 'Why ÷ √d_k' section, qkv lab scale's experiment "
                   "with a d_k slider (about a second to compute).")
@click.option("--hf", "hf_dir", metavar="DIR", default=None,
              help="With --text: the model view of a local transformers model folder (config.json, safetensors "
                   "weights, tokenizer; nothing is downloaded), its attention computed by qkv (qkv.hf); with "
                   "--generate: its generation view (a causal language model).")
@click.option("--compare", "compare_dir", metavar="DIR", default=None,
              help="With --hf A --text TEXT: compare the checkpoint in DIR with A (one architecture): each head "
                   "side by side, the heads ranked by the Jensen–Shannon divergence of their rows.")
@click.option("--text-file", "text_file", metavar="FILE", default=None,
              help="With --hf DIR: the long-input view of a UTF-8 text file (up to 32,768 tokens): every layer and "
                   "head summarised (entropy, mean distance, sink share, kind) and its map max-pooled, without the "
                   "N² weights.")
@click.option("--rows", "rows_opt", metavar="I,J,…", default=None,
              help="With --text-file: query rows whose weights the page carries exactly (0-based, −1 the last).")
@click.option("-o", "--output", default="attention.html", show_default=True, metavar="FILE", help="The HTML file.")
@lang_option("Language of the page (qkv.locales).")
def view_cmd(file, example, tokens, model_name, text, prompt, max_new_tokens, temperature, seed, chat, why, hf_dir,
             compare_dir, text_file, rows_opt, output, lang):
    """Write one self-contained HTML page (no network access; open it from disk, offline).

    The playground starts from seed 003's example, --example NAME or FILE: edit tokens, X, W_Q, W_K and W_V
    and everything is recomputed; hover a cell for its arithmetic; toggle the causal mask, the √d_k scaling,
    the number of heads. An example too large to edit shows its weights as a zoomable picture instead. Below
    it, "Why ÷ √d_k": qkv lab scale's numbers with a d_k slider (--no-why leaves it out).

    --text "A sentence." adds every layer and head of the MiniLM model; --model smollm2 --text "..." those of
    the decoder (up to 1,024 tokens); --generate "PROMPT" (--model smollm2) the generation view: step through
    the generated tokens and see which earlier tokens each attended to, in every layer and head. --hf DIR
    --text "..." shows every layer and head of a local transformers model folder, run on qkv (qkv.hf); --hf DIR
    --generate "PROMPT" its generation view; --hf A --compare B --text "..." how each head moved from A to B;
    --hf DIR --text-file FILE [--rows 0,100,-1] the long-input view (up to 32,768 tokens): every head's
    summary and max-pooled map without the N² weights, and the rows asked for exactly.
    The page opens on the model view asked for; the playground and "Why ÷ √d_k" are folded below it.
    """
    from qkv import viz

    _check_output(output, (".html", ".htm"))
    if text_file is not None or rows_opt is not None:               # the long-input view (issue 41)
        if compare_dir is not None:
            raise UserError("give either --text-file FILE or --compare DIR, not both")
        return _view_long(hf_dir, text, text_file, rows_opt, prompt, output, lang)
    if compare_dir is not None and hf_dir is None:
        raise UserError("--compare DIR: compares two model folders; give the first with --hf DIR "
                        "(qkv view --hf A --compare B --text TEXT)")
    if hf_dir is not None:
        _check_hf(text, prompt, compare_dir)
        name, hf_model = None, _model_weights.load_hf(hf_dir)
    else:
        name, hf_model = _view_model(model_name, text, prompt, lang), None
    if prompt is not None:                                         # before the worked example and the model
        from qkv.cli.generate_cmd import check_sampling_options
        if not prompt.strip():
            raise UserError("--generate: expected a non-empty prompt")
        check_sampling_options(_VIEW_OPTIONS, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                               chat=chat)
    data = {"playground": None, "notices": []}
    if prompt is None or file is not None or example is not None:
        worked = _load_worked(example, file, lang)
        data["example"] = viz.worked_data(worked, tokens=_tokens(tokens, len(worked.tokens), "one per row of X"))
        if why:
            data["why"] = viz.why_data()
    if prompt is not None and hf_model is not None:
        data["generation"] = generation_rows(hf_model, prompt, max_new_tokens=max_new_tokens, chat=chat,
                                            temperature=temperature, seed=seed)
    elif prompt is not None:
        from qkv.cli.generate_cmd import load_smollm2, option_error
        model = load_smollm2(lang)
        try:
            data["generation"] = viz.generation_data(model, prompt, max_new_tokens=max_new_tokens, chat=chat,
                                                     temperature=temperature, seed=seed)
        except (ValueError, TypeError) as exc:                     # the prompt's length, the page's limits
            raise option_error(exc, _VIEW_OPTIONS) from None
    elif compare_dir is not None:
        data["compare"] = _compare_view_data(hf_model, compare_dir, text)
    elif text is not None:
        data["model"] = _model_view_data(viz, name, text, lang, model=hf_model)
    data["first"] = next((k for k in ("generation", "compare", "model") if k in data), None)
    from qkv.viz.page_data import normalize
    data = normalize(data)                                         # worked_data's notices, generation's model view
    for n in data["notices"]:
        _note(n["key"], lang, n["args"])
    fl = (data.get("model") or {}).get("flow_limit")
    if fl:                                                         # the page says it too, beside the rollout
        _note("page.flow_missing" if fl["reason"] == "networkx" else "page.flow_too_big", lang,
              {"limit": fl["limit"], "layers": fl["layers"], "tokens": data["model"]["T"]})
    try:
        _write(lambda p: viz.write_page(p, data, lang=lang), output)
    except viz.PageTooLarge as exc:
        raise UserError(str(exc)) from None
    if output != "-":                                     # (standard output carried the output itself)
        click.echo(f"wrote {output}")


# ---------------------------------------------------------------------------------------------- view: long inputs
def _read_text_file(path: str) -> str:
    """The UTF-8 text of ``--text-file``; one line naming the option for a missing, unreadable or non-UTF-8 file."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise UserError(f"--text-file: cannot read {path!r}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"--text-file: {path!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                        f"{exc.start:,})") from None
    if not text.strip():
        raise UserError(f"--text-file: {path!r} holds no text")
    return text


def _parse_rows(value: str) -> list[int]:
    """``--rows 0,100,-1`` as ints; one line naming the option otherwise."""
    try:
        rows = [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        rows = []
    if not rows:
        raise UserError(f"--rows: expected query rows as integers separated by commas (0,100,-1), got {value!r}")
    return rows


def _view_long(hf_dir, text, text_file, rows_opt, prompt, output: str, lang: str) -> None:
    """``qkv view --hf DIR --text-file FILE [--rows …]``: the page of the long-input view alone
    (:mod:`qkv.viz.page_long`)."""
    from qkv import viz
    from qkv.viz.page_long import long_data

    if text_file is None:
        raise UserError("--rows: works with --text-file FILE (the long-input view)")
    if text is not None or prompt is not None:
        raise UserError("give either --text-file FILE or " + ("--text TEXT" if text is not None else
                                                              "--generate PROMPT") + ", not both")
    if hf_dir is None:
        raise UserError("--text-file: works with --hf DIR (a local transformers model folder)")
    _model_weights.check_hf_alone()
    rows = _parse_rows(rows_opt) if rows_opt is not None else None
    content = _read_text_file(text_file)
    model = _model_weights.load_hf(hf_dir)
    try:
        data = {"long": long_data(model, content, rows=rows, source=os.path.basename(text_file)), "first": "long"}
    except (ValueError, TypeError) as exc:                          # over the context, rows out of range, too large
        msg = str(exc)
        for name, option in (("text: ", "--text-file: "), ("rows: ", "--rows: ")):
            if msg.startswith(name):
                msg = option + msg[len(name):]
        raise UserError(msg) from None
    try:
        _write(lambda p: viz.write_page(p, data, lang=lang), output)
    except viz.PageTooLarge as exc:
        raise UserError(str(exc)) from None
    if output != "-":
        click.echo(f"wrote {output}")
