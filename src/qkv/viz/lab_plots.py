"""The lab's pictures: :mod:`qkv.lab`'s experiments return plain data, and these draw it (matplotlib, the ``viz``
extra), each written atomically to PNG, SVG or PDF by the file name's suffix.

    from qkv import lab, viz
    r = lab.train()
    viz.plot_lab("train", r, "train.png", lang="zh")

The lab never imports ``qkv.viz``, not even by name (it sits below it: ``tests/unit/test_layers_by_name.py``).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from qkv._extras import need
from qkv._files import atomic_write, output_kind
from qkv.tools.lab import NAMES, kind_name, method_name
from qkv.tools.lab.common import PLOT_SUFFIXES
from qkv.locales import t
from qkv.viz.heatmap import cjk_font, heatmap, is_cjk

__all__ = ["PLOTS", "label", "new_figure", "plot", "plot_heads", "plot_mask", "plot_scale", "plot_train",
           "save_atomic", "with_fonts"]


def plot(name: str, result: dict, path, lang: str = "en") -> str:
    """Draw ``result`` of the lab's experiment ``name`` to ``path`` (.png, .svg or .pdf; written atomically);
    needs matplotlib (``viz``)."""
    need("matplotlib", "qkv.viz.plot_lab")
    try:
        draw = PLOTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"name: expected one of {', '.join(NAMES)}, got {name!r}") from None
    return draw(result, path, lang)


# ----------------------------------------------------------------------------------------------- figures
def new_figure(width: float, height: float, *, layout: str | None = None):
    """An Agg figure (no display needed). Fixed margins by default (a layout engine measures every tick
    label and costs seconds); ``layout="constrained"`` for a figure that needs it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    if layout is None:
        fig.subplots_adjust(left=0.06, right=0.98, bottom=0.16, top=0.9, wspace=0.3)
    FigureCanvasAgg(fig)
    return fig


def with_fonts(fn):
    """Draw with a font list that has Chinese too (DejaVu Sans first, then qkv.viz's CJK font, when one is
    installed), so zh titles, axis labels and legends are drawn, not boxes."""
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        import matplotlib

        family = cjk_font()
        if family is None:
            return fn(*args, **kw)
        with matplotlib.rc_context({"font.family": ["DejaVu Sans", family]}):
            return fn(*args, **kw)
    return wrapper


def label(text) -> str:
    """Text for a plot: as it is when a CJK font is installed (:func:`with_fonts` draws it) or it has no CJK
    character; otherwise its CJK characters written as ``U+6211`` codes (as qkv.viz does), not boxes."""
    text = str(text)
    if not any(is_cjk(ch) for ch in text) or cjk_font() is not None:
        return text
    return "".join(f"U+{ord(ch):04X}" if is_cjk(ch) else ch for ch in text)


def save_atomic(fig, path) -> str:
    """Write ``fig`` to ``path`` (PNG, SVG or PDF by the suffix) through a temporary file in the same folder,
    renamed into place: a reader never sees a half-written picture, and a failure leaves no file behind."""
    import warnings

    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in PLOT_SUFFIXES and output_kind(path) != "file":
        suffix = ".png"                            # standard output, a pipe or a device: PNG unless named
    if suffix not in PLOT_SUFFIXES:
        raise ValueError(f"plot: expected a file name ending in {', '.join(PLOT_SUFFIXES)}, got {path!r}")
    with atomic_write(path, "wb") as fh, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        fig.savefig(fh, format=suffix[1:], dpi=120, metadata=_metadata(suffix))
    return path


def _metadata(suffix: str) -> dict:
    """No creation dates or software versions in the file: the same experiment writes the same bytes."""
    if suffix == ".png":
        return {"Software": None}
    if suffix == ".svg":
        return {"Date": None, "Creator": None}
    return {"CreationDate": None, "Creator": None, "Producer": None}


# ----------------------------------------------------------------------------------------------- the experiments
@with_fonts
def plot_scale(result: dict, path, lang: str = "en") -> str:
    """Three panels against d_k (log scale): variance with the theory lines, max weight, gradient norm."""
    r = result["rows"]
    d = [x["d_k"] for x in r]
    fig = new_figure(12, 3.6)
    axes = fig.subplots(1, 3)
    un, sc = label(t("lab.unscaled", lang)), label(t("lab.scaled", lang))
    drawable = label
    ax = axes[0]
    ax.loglog(d, [x["score_var"] for x in r], "o-", label=un)
    ax.loglog(d, [x["score_var_scaled"] for x in r], "s-", label=sc)
    ax.loglog(d, d, "k:", lw=1, label=drawable(t("lab.theory", lang)))
    ax.loglog(d, [1] * len(d), "k:", lw=1)
    ax.set_title(drawable(t("lab.col_var", lang)))
    ax = axes[1]
    ax.semilogx(d, [x["max_weight"] for x in r], "o-", label=un)
    ax.semilogx(d, [x["max_weight_scaled"] for x in r], "s-", label=sc)
    ax.set_ylim(0, 1.02)
    ax.set_title(drawable(t("lab.col_max_weight", lang)))
    ax = axes[2]
    ax.loglog(d, [x["grad_norm"] for x in r], "o-", label=un)
    ax.loglog(d, [x["grad_norm_scaled"] for x in r], "s-", label=sc)
    ax.set_title(drawable(t("lab.col_grad", lang)))
    for ax in axes:
        ax.set_xlabel("d_k")
        ax.legend(fontsize=8)
    return save_atomic(fig, path)


@with_fonts
def plot_mask(result: dict, path, lang: str = "en") -> str:
    """The weights of both sentences under each way of masking (rows: queries, columns: keys)."""
    methods = [r["method"] for r in result["methods"]]
    toks = result["tokens"]
    fig = new_figure(3.0 * len(methods), 5.6)
    axes = fig.subplots(len(toks), len(methods), squeeze=False)
    for j, m in enumerate(methods):
        for b, tk in enumerate(toks):
            w = np.array(result["weights"][m][b])
            heatmap(w, tk, tk, ax=axes[b][j], title=method_name(m, lang) if b == 0 else None, vmin=0.0, vmax=1.0,
                    colorbar=False, xlabel=None, ylabel=None, annotate=True, fmt="{:.2f}")
    return save_atomic(fig, path)


@with_fonts
def plot_heads(result: dict, path, lang: str = "en") -> str:
    """Accuracy along the steps for both models; each head's attention on one held-out sequence."""
    one, two = result["models"]
    fig = new_figure(12, 3.4)
    grid = fig.add_gridspec(1, 4, width_ratios=[1.3, 1, 1, 1])
    ax = fig.add_subplot(grid[0])
    for m in (one, two):
        ax.plot([s["step"] for s in m["steps"]], [s["accuracy"] for s in m["steps"]],
                label=label(t("lab.heads_label", lang, h=m["heads"], w=m["head_width"])))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(label(t("lab.col_step", lang)))
    ax.set_title(label(t("lab.col_accuracy", lang)))
    ax.legend(loc="lower right", fontsize=8)
    toks = result["example"]["tokens"]
    panels = [(one, 0)] + [(two, h) for h in range(two["heads"])]
    for i, (m, h) in enumerate(panels):
        a = fig.add_subplot(grid[i + 1])
        w = m["example_weights"][h]
        colors = ["tab:blue"] * len(toks)
        colors[-2] = "tab:green"
        colors[result["example"]["match"]] = "tab:orange"
        a.bar(range(len(toks)), w, color=colors)
        a.set_xticks(range(len(toks)), toks)
        a.set_ylim(0, 1)
        kind = kind_name(m["attention"][h]["kind"], lang)
        title = t("lab.heads_panel", lang, h=m["heads"], w=m["head_width"], head=h, kind=kind)
        a.set_title(label(title), fontsize=9)
    return save_atomic(fig, path)


@with_fonts
def plot_train(result: dict, path, lang: str = "en") -> str:
    """Loss; accuracy and attention to the antecedent along the steps; 它's scaled scores and weights on the
    seeds' sentence after training."""
    fig = new_figure(14, 3.6)
    axes = fig.subplots(1, 4)
    s = [r["step"] for r in result["steps"]]
    axes[0].semilogy(s, [r["loss"] for r in result["steps"]], color="tab:red")
    L = label
    axes[0].set_title(L(t("lab.col_loss", lang)))
    axes[0].set_xlabel(L(t("lab.col_step", lang)))
    axes[1].plot(s, [r["accuracy"] for r in result["steps"]], label=L(t("lab.col_accuracy", lang)))
    axes[1].plot(s, [r["attention"] for r in result["steps"]], label=L(t("lab.col_attention", lang)))
    axes[1].axhline(result["chance_attention"], color="gray", ls=":", lw=1, label=L(t("lab.chance", lang)))
    axes[1].set_ylim(0, 1.02)
    axes[1].set_xlabel(L(t("lab.col_step", lang)))
    axes[1].legend(loc="lower right", fontsize=8)
    ex = result["explain"]
    colors = ["tab:orange" if w == ex["antecedent"] else "tab:blue" for w in ex["tokens"]]
    x = range(len(ex["tokens"]))
    for ax, values, key in ((axes[2], ex["scaled_scores"], "lab.train_plot_scores"),
                            (axes[3], ex["weights"], "lab.train_plot_explain")):
        ax.bar(x, values, color=colors)
        ax.set_xticks(x, [L(w) for w in ex["tokens"]])
        ax.set_title(L(t(key, lang, query=ex["query"])))
    axes[2].axhline(0, color="black", lw=0.5)
    axes[3].set_ylim(0, 1)
    return save_atomic(fig, path)


#: Each experiment's picture, by the name ``qkv lab NAME`` takes.
PLOTS = {"scale": plot_scale, "mask": plot_mask, "heads": plot_heads, "train": plot_train}
