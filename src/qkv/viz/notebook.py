"""Notebooks: ``qkv.viz.show(obj)`` → an object whose ``_repr_html_()`` is the offline page, self-contained.

    import qkv
    qkv.viz.show(trace)                       # a qkv.Trace: the playground when it can be rebuilt, every head
    qkv.viz.show(model.run("A sentence."))    # a BertOutput or LlamaOutput: every layer and head
    qkv.viz.show(worked, lang="zh")           # a worked example (qkv.explain.examples), in Chinese
    qkv.viz.show(qkv.explain.check(worked))   # a check report
    qkv.viz.show(weights, tokens=[...])       # attention weights (…, L, S): one map per head

The page (:func:`qkv.viz.render_page`: inline CSS, JavaScript and data, a Content-Security-Policy that forbids
any network access) goes into an ``<iframe srcdoc=…>`` sandboxed to scripts only, so it needs no CDN and no
notebook extension, and keeps working when the notebook is saved and opened again offline (where the
notebook's own trust rules let an output run its scripts; the check report is plain HTML and needs none).
:class:`qkv.Trace` and the models' outputs have ``_repr_html_`` themselves, delegating here.
"""
from __future__ import annotations

import html as _html

import numpy as np

from qkv import _display
from qkv.viz import page as _page

__all__ = ["Shown", "show", "DEFAULT_HEIGHT"]

#: The iframe's height in CSS pixels when not given (the page scrolls inside it).
DEFAULT_HEIGHT = 720


class Shown:
    """What :func:`show` returns: ``.html`` (a whole page, or an HTML fragment for a check report),
    ``_repr_html_()`` for notebooks, ``save(path)``."""

    def __init__(self, html: str, *, page: bool = True, height: int = DEFAULT_HEIGHT, title: str = "qkv"):
        self.html, self.page, self.height, self.title = html, page, int(height), title

    def _repr_html_(self) -> str:
        if not self.page:
            return self.html
        return (f'<iframe srcdoc="{_html.escape(self.html, quote=True)}" sandbox="allow-scripts" '
                f'title="{_html.escape(self.title, quote=True)}" data-qkv="page" '
                f'style="width: 100%; height: {self.height}px; border: 1px solid #cbd2d9; border-radius: 4px;">'
                f'</iframe>')

    def save(self, path) -> str:
        """Write the page (or the fragment) to ``path``; returns the path."""
        import os

        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.html)
        return path

    def __repr__(self) -> str:
        kind = "page" if self.page else "fragment"
        return f"Shown({kind}, {len(self.html):,} characters)"


def show(obj, lang: str = "en", *, tokens=None, name: str | None = None, index: int = 0,
         height: int | None = None) -> Shown:
    """The page (or report) for ``obj``, for a notebook cell.

    Args:
        obj: a :class:`qkv.Trace`, a model output (``BertOutput``/``LlamaOutput``: text ``index`` of the batch),
            a worked example (``qkv.explain.examples.Worked``), a check report (``qkv.explain.check``), page data
            (a dict for :func:`qkv.viz.render_page`), attention weights (an array (…, L, S)), or a
            :class:`Shown` (returned as is).
        lang: the page's language (a :mod:`qkv.locales` language: ``"en"``, ``"zh"``, …).
        tokens: labels of the query rows (traces and arrays; default t0, t1, …).
        name: the title of a model output's or an array's view.
        height: the iframe's height in CSS pixels (default :data:`DEFAULT_HEIGHT`).
    """
    from qkv import locales

    lang = locales.check_lang(lang)
    if isinstance(obj, Shown):
        return obj
    report = _check_report_html(obj, lang)
    if report is not None:
        return Shown(report, page=False)
    data = _data(obj, tokens=tokens, name=name, index=index)
    text = _page.render_page(data, lang=lang)
    return Shown(text, height=height or DEFAULT_HEIGHT, title=_title(data))


def _title(data: dict) -> str:
    for key in ("playground", "example", "generation", "model"):
        part = data.get(key)
        if part:
            return str(part.get("title") or part.get("name") or "qkv")
    return "qkv"


def _check_report_html(obj, lang: str) -> str | None:
    try:
        from qkv.explain.checker import CheckReport
    except ImportError:                                           # pragma: no cover - a broken install
        return None
    if not isinstance(obj, CheckReport):
        return None
    colours = {"correct": "#15803d", "carried": "#b45309", "wrong": "#c81e1e"}
    status = "correct" if obj.ok else ("wrong" if obj.roots else "carried")
    text = _html.escape(obj.render(lang=lang, fmt="text"))
    return (f'<div class="qkv-check" lang="{_html.escape(lang)}" data-qkv="check" data-ok="{str(obj.ok).lower()}" '
            f'style="border-left: 4px solid {colours[status]}; padding: .4rem .8rem; background: #f8fafc;">'
            f'<pre style="white-space: pre-wrap; margin: 0; font-family: ui-monospace, \'Noto Sans Mono\', '
            f'\'DejaVu Sans Mono\', monospace; unicode-bidi: isolate;">{text}</pre></div>')


def _data(obj, *, tokens, name, index) -> dict:
    from qkv.core.tracing import Trace

    if isinstance(obj, dict):
        return obj
    if isinstance(obj, Trace):
        return _trace_data(obj, tokens=tokens, name=name)
    try:
        from qkv.explain.examples import Worked
    except ImportError:                                           # pragma: no cover
        Worked = ()
    if Worked and isinstance(obj, Worked):
        return {"example": _page.worked_data(obj, tokens=tokens)}
    if hasattr(obj, "attentions") and hasattr(obj, "attention_mask") and hasattr(obj, "tokens"):
        return {"model": _output_data(obj, index=index, name=name)}
    if isinstance(obj, np.ndarray) or (hasattr(obj, "__array__") and not isinstance(obj, (str, bytes))):
        return {"example": _weights_data(np.asarray(obj), tokens=tokens, name=name or "attention weights")}
    if hasattr(obj, "prompt_ids") and hasattr(obj, "ids"):
        raise TypeError("show: a Generation holds no attention weights; use qkv.viz.generation_data(model, "
                        "prompt) (or qkv view --model smollm2 --generate PROMPT)")
    raise TypeError(f"show: expected a qkv.Trace, a model output, a worked example, a check report, page data or "
                    f"attention weights, got {type(obj).__name__}")


def _labels(tokens, n: int) -> list[str]:
    if tokens is None:
        return [f"t{i}" for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"tokens: expected {n} labels (one per query row), got {len(tokens)}")
    return tokens


def _weights_data(w: np.ndarray, *, tokens, name: str, kv_tokens=None) -> dict:
    """The canvas view of attention weights (…, L, S): one map per leading index (heads, batch)."""
    if w.ndim < 2 or 0 in w.shape:
        raise ValueError(f"weights: expected an array (…, L, S) of attention weights, got shape {w.shape}")
    L, S = w.shape[-2:]
    maps = w.reshape(-1, L, S)
    _page._check_cells(maps.shape[0], L, S, False, f"weights of shape {w.shape}")
    data = _page._layers_data([maps], 1, maps.shape[0], L, False, what=name, cols=S)
    rows = _labels(tokens, L)
    cols = kv_tokens if kv_tokens is not None else (rows if S == L else [f"k{j}" for j in range(S)])
    data.update({"kind": "example", "name": name, "text": None, "tokens": rows,
                 "kv_tokens": None if cols is rows else list(cols), "decoder": False})
    return data


def _trace_data(trace, *, tokens, name) -> dict:
    """A trace: the playground when it can be rebuilt from the recorded steps (one 2-D head from X), and the
    recorded weights of every head."""
    if "weights" not in trace:
        names = ", ".join(trace.names()) or "nothing"
        raise ValueError(f"trace: expected a recorded 'weights' step to show, the trace has {names}")
    w = np.asarray(trace["weights"].array)
    L = w.shape[-2]
    out = {"playground": None, "example": _weights_data(w, tokens=tokens, name=name or "qkv.Trace")}
    pg = _trace_playground(trace, tokens)
    if pg is not None and _page._playground_cells(pg) <= _page.PLAYGROUND_MAX_CELLS:
        out["playground"] = pg
        if w.reshape(-1, L, w.shape[-1]).shape[0] == 1:
            out["example"] = None                                 # one head: the playground shows it all
    return out


def _trace_playground(trace, tokens):
    need = ("X", "Q", "K", "V", "scores", "scaled", "weights")
    if any(n not in trace for n in need) or any(n in trace for n in ("masked", "Q_heads", "Q_rot", "biased")):
        return None
    steps = {n: trace[n] for n in need}
    if any(np.asarray(s.array).ndim != 2 for s in steps.values()):
        return None
    if any(steps[n].op != "matmul" or steps[n].operands.get("bias") is not None for n in ("Q", "K", "V")):
        return None
    X = steps["Q"].operands["a"]
    Xkv = steps["K"].operands["a"]
    scaled = steps["scaled"].params
    d_k = scaled.get("d_k")
    if not scaled.get("is_default", False):
        return None
    try:
        return _page.playground_data(X, steps["Q"].operands["b"], steps["K"].operands["b"], steps["V"].operands["b"],
                                     X_kv=None if Xkv is X else Xkv, tokens=tokens,
                                     d_k=None if d_k == steps["Q"].shape[-1] else d_k, title="qkv.Trace")
    except ValueError:
        return None


def _output_data(out, *, index: int, name) -> dict:
    """A model output (BertOutput, LlamaOutput): text ``index`` of the batch, every layer and head."""
    B = len(out.tokens)
    if not isinstance(index, int) or not 0 <= index < B:
        raise ValueError(f"index: expected a text of the batch, 0 … {B - 1}, got {index!r}")
    T = int(np.asarray(out.attention_mask)[index].sum())
    atts = [np.asarray(a)[index, :, :T, :T] for a in out.attentions]
    L, H = len(atts), atts[0].shape[0]
    causal = hasattr(out, "logits")                               # the decoder's output
    _page._check_cells(L * H, T, T, causal, f"a text of {T:,} tokens")
    kv = np.asarray(out.keys[0]).shape[1] if getattr(out, "keys", None) else H
    tokens = [str(t) for t in out.tokens[index][:T]]
    data = _page._layers_data(atts, L, H, T, causal, what=f"a text of {T:,} tokens", tokens=tokens)
    data.update({"kind": "model", "name": name or ("decoder" if causal else "encoder") + f" ({type(out).__name__})",
                 "text": None, "tokens": tokens, "decoder": causal, "kv_heads": int(kv)})
    return data


_display.register(show)   # qkv.Trace and the models' outputs show themselves in notebooks through it
