"""``qkv model``: what one token of a sentence attends to in a real pretrained model (all-MiniLM-L6-v2, or
with ``--model smollm2`` the decoder SmolLM2-135M-Instruct: causal, RoPE, 9 query heads sharing 3 key/value heads;
or with ``--hf DIR`` any local transformers model folder, run on qkv through :mod:`qkv.hf`).

Everything shown comes from one ``trace_layer`` call (:meth:`qkv.models.BertModel.trace_layer`,
:meth:`qkv.models.LlamaModel.trace_layer`): the layer's self-attention run through
:class:`qkv.MultiHeadAttention` with a trace. The weights listed, the table and ``--explain``'s hand
calculation are read from that trace.
"""
from __future__ import annotations

import types

import re
import sys
import warnings

import click
import numpy as np

from qkv.locales import t

from qkv.cli import UserError, _model_weights
from qkv.cli._app import cli
from qkv.cli._model_option import check_model, model_option
from qkv.cli.explain_cmd import lang_option

_MODEL = []


def _load_model(m, name="minilm", lang="en"):
    """all-MiniLM-L6-v2 (or SmolLM2), loaded once per process (tests call the command many times)."""
    if name == "smollm2":
        from qkv.cli.generate_cmd import load_smollm2
        return load_smollm2(lang)
    if not _MODEL:
        try:
            from qkv.models import load_bert
            _MODEL.append(load_bert())
        except ImportError:
            raise UserError(m("model.extra")) from None
    return _MODEL[0]


def find_token(tokens: list[str], token: str, normalize=None) -> tuple[int, list[int]]:
    """The index of ``token`` in ``tokens`` and every index where it occurs.

    ``token`` is matched as the tokenizer wrote it; failing that, after the tokenizer's normalization
    (e.g. lowercasing ``It`` → ``it``); ``#N`` is the index N. Raises LookupError / IndexError.
    """
    m = re.fullmatch(r"#(\d+)", token.strip())
    if m:
        i = int(m.group(1))
        if i >= len(tokens):
            raise IndexError(i)
        return i, [i]
    for candidate in dict.fromkeys([token, token.strip()] + ([normalize(token.strip())] if normalize else [])):
        hits = [i for i, t in enumerate(tokens) if t == candidate]
        if hits:
            return hits[0], hits
    raise LookupError(token)


def _find(m, model, decoder: bool, tokens: list[str], token: str, shown: str) -> tuple[int, list[int]]:
    """:func:`find_token` with the model's own normalizer (MiniLM lower-cases; the decoder none), its
    errors as one-line UserErrors."""
    normalize = None if decoder else getattr(model.tokenizer.normalizer, "normalize_str", None)
    try:
        return find_token(tokens, token, normalize)
    except IndexError:
        raise UserError(m("model.bad_index", tok=token, last=len(tokens) - 1)) from None
    except LookupError:
        raise UserError(m("model.no_token", tok=token, tokens=shown, last=len(tokens) - 1)) from None


def _shown(tok: str) -> str:
    """A decoder token as the command shows and matches it: without its spaces (' it' → 'it'); a token of
    only white space spelled out ('␣', '\\n')."""
    return tok.strip() or tok.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _fmt_tok(tokens: list[str], j: int) -> str:
    return f"{tokens[j]}#{j}" if tokens.count(tokens[j]) > 1 else tokens[j]


def _check_args(m, text, top, head, all_heads) -> None:
    """The checks that need no model: a text, valid UTF-8, --top in range, not --head with --all-heads."""
    if not text.strip():
        raise UserError(m("model.empty"))
    from qkv.models import check_utf8
    check_utf8(text, "TEXT")                       # a ValueError: one line, exit 2
    if not 1 <= top <= MAX_TOP:
        raise UserError(m("model.bad_top", got=top, most=MAX_TOP))
    if head is not None and all_heads:
        raise UserError(m("model.both"))


def _explainer(m, explain):
    """:func:`qkv.explain.explain_query` with --explain (a UserError when it cannot be imported), else None."""
    if not explain:
        return None
    try:
        from qkv.explain import explain_query
    except ImportError as exc:
        raise UserError(m("model.no_explain", err=exc)) from None
    return explain_query


def _check_range(m, c, layer, head) -> None:
    if not 0 <= layer < c.num_layers:
        raise UserError(m("model.bad_layer", last=c.num_layers - 1, n=c.num_layers, got=layer))
    if head is not None and not 0 <= head < c.num_heads:
        raise UserError(m("model.bad_head", last=c.num_heads - 1, n=c.num_heads, got=head))


def _tokenize(m, model, text, decoder) -> list[str]:
    """The text's tokens as the command shows them; the tokenizer's warnings (truncation) echoed to stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.tokenize(text)
    if decoder:
        tokens = [_shown(s) for s in tokens]
    for w in caught:
        click.echo(f"qkv: {m('model.warning')}: {w.message}", err=True)
    return tokens


def _all_layers(m, model, decoder, text, tokens, token, shown, heads_summary, rollout, top, fusion) -> None:
    """``--heads-summary`` and/or ``--rollout``: views over every layer from one run of the model."""
    q = None if token is None else _find(m, model, decoder, tokens, token, shown)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # the truncation warning was shown above
        out = model.run([text])
    attentions = [np.asarray(a)[0, :, :len(tokens), :len(tokens)] for a in out.attentions]
    del out
    from qkv.viz import heads as viz_heads
    name = viz_heads.model_name(model)
    if heads_summary:
        _heads_summary(m, viz_heads, attentions, tokens, name, decoder)
    if rollout:
        if heads_summary:
            click.echo("")
        _rollout(m, viz_heads, attentions, tokens, name, q, top, fusion)


def _one_head(m, tokens, weights, scaled, i, k, layer, head) -> None:
    """``--head``: the top-k keys of query i with their weights and scaled scores."""
    click.echo(m("model.heading_head", layer=layer, head=head, tok=tokens[i], i=i))
    row, srow = weights[head, i], scaled[head, i]
    order = np.argsort(-row, kind="stable")[:k]
    width = max(_cells(_fmt_tok(tokens, j)) for j in order)
    click.echo(f"  {_rjust(m('model.rank'), 4)}  {_ljust(m('model.token'), width)}  "
               f"{_rjust(m('model.weight'), 8)}  {_rjust(m('model.score'), 8)}")
    for r, j in enumerate(order, 1):
        click.echo(f"  {r:>4}  {_ljust(_fmt_tok(tokens, j), width)}  {row[j]:8.4f}  {srow[j]:8.3f}")


def _every_head(m, tokens, weights, i, k, layer, num_heads) -> None:
    """The default view: one line per head, the top-k keys of query i."""
    click.echo(m("model.heading", layer=layer, tok=tokens[i], i=i))
    for h in range(num_heads):
        row = weights[h, i]
        order = np.argsort(-row, kind="stable")[:k]
        items = "  ".join(f"{_fmt_tok(tokens, j)} {row[j]:.3f}" for j in order)
        click.echo(f"  {m('model.head')} {h:>2}: {items}")


def _explain(m, c, explain_query, trace, i, head, decoder, lang, tokens) -> None:
    """``--explain``: the hand calculation of query i in one head (head 0 unless --head), read from the trace."""
    h = 0 if head is None else head
    if head is None:
        click.echo(m("model.explain_head0"))
    if decoder:
        kv, group = c.kv_head(h), c.group_size
        click.echo(m("model.gqa_note", head=h, kv=kv, first=kv * group, last=(kv + 1) * group - 1,
                     h=c.num_heads, hk=c.num_kv_heads, theta=f"{c.rope_theta:g}"))
    click.echo("")
    click.echo(explain_query(trace, i, head=h, batch=0, lang=lang, fmt="text", precision=4,
                             tokens=tokens, kv_tokens=tokens))


#: The most tokens --top lists (the longest text a model view takes: SmolLM2 up to 1,024 tokens).
MAX_TOP = 1024

@cli.command("model")
@click.argument("text")
@click.option("--layer", "-l", type=int, default=0, show_default=True, help="The layer (0-based).")
@click.option("--head", "-H", "head", type=int, default=None,
              help="One head (0-based); default: every head of the layer.")
@click.option("--token", "-t", default=None, metavar="TOKEN",
              help="The query token, as the tokenizer wrote it (e.g. it, ##ing, 北), or '#N' for index N.")
@click.option("--top", "-k", "top", type=int, default=5, show_default=True,
              help="How many tokens to list (1 … 1024; more than the text has lists them all).")
@click.option("--all-heads", is_flag=True, help="A summary table: one row per head of the layer.")
@click.option("--explain", is_flag=True,
              help="Show this query's calculation (q, q·k, scaling, softmax, weighted sum) from the trace.")
@model_option("minilm", help_text="The model: minilm, all-MiniLM-L6-v2 (encoder), or smollm2, SmolLM2-135M-Instruct "
                                  "(decoder).")
@click.option("--heads-summary", is_flag=True,
              help="Every layer × head at a glance: what each head attends to (previous token, next, same token, "
                   "[CLS]/[SEP] sink, long-range, broad), as a chart (qkv.viz.head_kinds).")
@click.option("--rollout", is_flag=True,
              help="Attention rollout and flow through all layers (Abnar & Zuidema 2020): the input tokens that "
                   "reach each position (or --token's) after the last layer.")
@click.option("--fusion", type=click.Choice(["mean", "max", "min"]), default="mean", show_default=True,
              help="With --rollout: how the heads of a layer are fused.")
@click.option("--hf", "hf_dir", metavar="DIR", default=None,
              help="A local transformers model folder instead (config.json, safetensors weights, tokenizer; nothing is "
                   "downloaded): its attention computed by qkv (qkv.hf).")
@lang_option("Language of the output (qkv.locales).")
def model_cmd(text, layer, head, token, top, all_heads, explain, model_name, heads_summary, rollout, fusion, hf_dir,
              lang):
    """What one token attends to in all-MiniLM-L6-v2 (6 layers × 12 heads), computed by qkv's attention.

    Example: qkv model "The animal didn't cross the street because it was too tired." --layer 2 --token it

    With --model smollm2: the decoder SmolLM2-135M-Instruct (30 layers × 9 query heads sharing 3 key/value
    heads, RoPE, causal: a token attends only to itself and the tokens before it). Its tokens are shown
    without their leading space (' it' as it).

    With --hf DIR: any local transformers model folder (config.json, safetensors, tokenizer; nothing is
    downloaded), every attention layer run on qkv (qkv.hf); a decoder is causal, its tokens decoded one by one.

    Without --token it lists the text's tokens. Layers, heads and token indices count from 0. When a token
    occurs more than once the first is used (say '#N' for another). Chinese text works: the tokenizer
    splits CJK characters (this uncased English vocabulary knows only some of them; the rest are [UNK]).
    """
    def m(key: str, **kw) -> str:
        return t(key, lang, **kw)
    if hf_dir is not None:
        _model_weights.check_hf_alone()
    else:
        model_name = check_model(model_name, "qkv model", lang=lang)
    _check_args(m, text, top, head, all_heads)
    explain_query = _explainer(m, explain)
    if hf_dir is not None:
        model = _model_weights.load_hf(hf_dir)
        decoder = model.config.decoder
    else:
        decoder = model_name == "smollm2"
        model = _load_model(m, model_name, lang)
    c = model.config
    _check_range(m, c, layer, head)
    tokens = _tokenize(m, model, text, decoder)
    shown = " ".join(f"{t}" for t in tokens)
    if heads_summary or rollout:
        _all_layers(m, model, decoder, text, tokens, token, shown, heads_summary, rollout, top, fusion)
        return 0
    if token is None:
        click.echo(m("model.tokens", n=len(tokens), tokens=shown))
        click.echo(m("model.pick"))
        return 0
    i, hits = _find(m, model, decoder, tokens, token, shown)
    if len(hits) > 1:
        click.echo(m("model.dup", tok=tokens[i], k=len(hits), where=", ".join(f"#{h}" for h in hits), i=i))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                      # the truncation warning was shown above
        trace = model.trace_layer(text, layer)
    weights = trace["weights"].array[0]                      # (H, T, T), the softmax MultiHeadAttention ran
    scaled = trace["scaled"].array[0]                        # (H, T, T), q·k / √d_k
    k = min(top, len(tokens))
    if all_heads:
        _table(m, tokens, weights, i, k, layer, decoder)
    elif head is not None:
        _one_head(m, tokens, weights, scaled, i, k, layer, head)
    else:
        _every_head(m, tokens, weights, i, k, layer, c.num_heads)
    if explain_query is not None:
        _explain(m, c, explain_query, trace, i, head, decoder, lang, tokens)
    return 0


def _cells(s: str) -> int:
    try:
        from rich.cells import cell_len
    except ImportError:                                      # pragma: no cover - rich comes with the cli extra
        return len(s)
    return cell_len(s)


def _ljust(s: str, width: int) -> str:
    return s + " " * max(0, width - _cells(s))


def _rjust(s: str, width: int) -> str:
    return " " * max(0, width - _cells(s)) + s


def _table(m, tokens, weights, i, k, layer, decoder=False):
    """One row per head: the top-k keys of query i, the entropy of its weights, the weight on [CLS]+[SEP]
    (a decoder's: on its first token, where attention with nothing better to do collects)."""
    special = [0] if decoder else [j for j, t in enumerate(tokens) if t in ("[CLS]", "[SEP]")]
    rows = []
    for h in range(weights.shape[0]):
        row = weights[h, i].astype(np.float64)
        order = np.argsort(-row, kind="stable")[:k]
        top = "  ".join(f"{_fmt_tok(tokens, j)} {row[j]:.3f}" for j in order)
        nz = row[row > 0]
        entropy = float(-(nz * np.log2(nz)).sum())
        rows.append((str(h), top, f"{entropy:.2f}", f"{row[special].sum():.3f}"))
    title = m("model.table_title", layer=layer, tok=tokens[i], i=i)
    header = (m("model.head"), m("model.top", k=k), m("model.entropy"),
              m("model.first_token" if decoder else "model.special"))
    if sys.stdout.isatty():
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:                                  # pragma: no cover
            pass
        else:
            table = Table(title=title)
            for n, name in enumerate(header):
                table.add_column(name, justify="right" if n != 1 else "left")
            for r in rows:
                table.add_row(*r)
            Console().print(table)
            return
    click.echo(title)
    widths = [max(_cells(r[n]) for r in rows + [header]) for n in range(4)]
    click.echo("  ".join(_ljust(hd, w) for hd, w in zip(header, widths)).rstrip())
    for r in rows:
        click.echo("  ".join(_ljust(cell, w) if n == 1 else " " * (w - _cells(cell)) + cell
                             for n, (cell, w) in enumerate(zip(r, widths))).rstrip())


#: The words of the --heads-summary legend (qkv.viz.heads.KINDS, and the mixed heads' note).
KIND_KEYS = types.MappingProxyType(
    {"previous": "model.kind_previous", "next": "model.kind_next", "same": "model.kind_same",
     "sink": "model.kind_sink", "long_range": "model.kind_long_range", "broad": "model.kind_broad",
     "mixed": "model.kind_mixed"})


def _heads_summary(m, viz_heads, attentions, tokens, name, decoder):
    """``--heads-summary``: the layer × head chart of :func:`qkv.viz.head_kinds`, its legend and the strongest
    head of each kind."""
    hk = viz_heads.head_kinds(attentions, tokens)
    L, H = hk.shape
    names = {k: m(key) for k, key in KIND_KEYS.items()}
    click.echo(m("model.hs_title", name=name, layers=L, heads=H, n=len(tokens)))
    click.echo(hk.chart(names))
    parts = []
    for k in viz_heads.KINDS:
        layer, head, score = hk.strongest(k)
        parts.append(m("model.hs_best", kind=names[k], layer=layer, head=head, score=f"{score:.2f}"))
    click.echo(m("model.hs_strongest", items="; ".join(parts)))
    click.echo(m("model.hs_how", near=hk.near))


def _rollout(m, viz_heads, attentions, tokens, name, q, top, fusion):
    """``--rollout``: attention rollout for every position (or the --token one), and attention flow where the
    graph is small enough for max-flow."""
    R = viz_heads.rollout(attentions, head_fusion=fusion)
    L, T = len(attentions), len(tokens)
    queries = list(range(T)) if q is None else [q]
    F, flow_note = None, None
    if viz_heads.flow_work(L, T, len(queries)) <= viz_heads.MAX_FLOW_WORK:
        try:
            F = viz_heads.attention_flow(attentions, head_fusion=fusion, queries=queries)
        except ImportError:
            flow_note = m("model.flow_missing")
    else:
        flow_note = m("model.flow_too_big", n=T)
    click.echo(m("model.rollout_title", name=name, layers=L, fusion=fusion))
    k = min(top, T)
    for r, i in enumerate(queries):
        order = np.argsort(-R[i], kind="stable")[:k]
        items = "  ".join(f"{_fmt_tok(tokens, j)} {R[i, j]:.3f}" for j in order)
        click.echo(f"  {_fmt_tok(tokens, i)} (#{i})  {m('model.rollout')}: {items}")
        if F is not None:
            order = np.argsort(-F[r], kind="stable")[:k]
            items = "  ".join(f"{_fmt_tok(tokens, j)} {F[r, j]:.3f}" for j in order)
            pad = " " * (_cells(f"  {_fmt_tok(tokens, i)} (#{i})  ") - 2)
            click.echo(f"  {pad}{m('model.flow')}: {items}")
    if flow_note:
        click.echo(flow_note)
