"""Attention heatmaps with matplotlib (the ``viz`` extra), drawn off-screen with the Agg backend.

    heatmap(weights, row_labels, col_labels)    one (L, S) matrix on one Axes; queries are rows, keys columns
    heads_grid(weights, row_labels, col_labels) (H, L, S): one small heatmap per head, in a grid
    save(fig, path)                             PNG, SVG or PDF, chosen by the file name's suffix

Labels in Chinese (or Japanese, Korean) need a font that has those characters: :func:`cjk_font` looks for
one among the installed fonts (Debian's ``fonts-noto-cjk`` provides Noto Sans CJK). When there is none, qkv
warns once with the install hint and writes such characters as ``U+6211`` instead of drawing empty boxes.
matplotlib is imported inside the functions, so ``import qkv.viz`` costs nothing without it.
"""
from __future__ import annotations

import functools
import os
import warnings

import numpy as np

#: CJK families to prefer, best first; any other installed family whose name contains "CJK" comes next.
CJK_FAMILIES = (
    "Noto Sans CJK SC", "Noto Sans CJK TC", "Noto Sans CJK JP", "Noto Sans CJK KR", "Noto Sans CJK HK",
    "Source Han Sans SC", "Source Han Sans CN", "Noto Sans SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
    "Droid Sans Fallback", "AR PL UMing CN", "AR PL UKai CN", "Noto Serif CJK SC", "SimHei",
    "Microsoft YaHei", "PingFang SC", "Heiti SC", "Hiragino Sans GB", "Arial Unicode MS",
)
INSTALL_HINT = "apt-get install fonts-noto-cjk"
#: Matrices with at most this many cells get their values written in the cells when ``annotate=None``.
ANNOTATE_MAX_CELLS = 144
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}

_warned_no_cjk = False


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("qkv heatmaps need matplotlib: pip install 'qkv[viz]'") from None
    return matplotlib


@functools.lru_cache(maxsize=1)
def cjk_font() -> str | None:
    """The family name of an installed font with CJK characters, or None when there is none."""
    _matplotlib()
    from matplotlib import font_manager

    names = {f.name for f in font_manager.fontManager.ttflist}
    for family in CJK_FAMILIES:
        if family in names:
            return family
    others = sorted(n for n in names if "CJK" in n)
    return others[0] if others else None


def is_cjk(ch: str) -> bool:
    """True for a character of the CJK scripts (Han, kana, Hangul, CJK punctuation, full-width forms)."""
    cp = ord(ch)
    return (0x2E80 <= cp <= 0x9FFF or 0xA960 <= cp <= 0xA97F or 0xAC00 <= cp <= 0xD7FF
            or 0xF900 <= cp <= 0xFAFF or 0xFE30 <= cp <= 0xFE4F or 0xFF00 <= cp <= 0xFFEF
            or 0x20000 <= cp <= 0x3FFFF)


def _has_cjk(texts) -> bool:
    return any(is_cjk(ch) for t in texts if t for ch in str(t))


def _text_style(texts) -> tuple[dict, callable]:
    """Font keywords for text that may hold CJK characters, and a function that makes a label drawable."""
    global _warned_no_cjk
    if not _has_cjk(texts):
        return {}, str
    family = cjk_font()
    if family is not None:
        return {"fontfamily": [family, "DejaVu Sans"]}, str
    if not _warned_no_cjk:
        _warned_no_cjk = True
        warnings.warn(f"no font with Chinese/Japanese/Korean characters is installed, so those characters "
                      f"are written as U+XXXX codes; install one with: {INSTALL_HINT}", UserWarning,
                      stacklevel=3)

    def drawable(t) -> str:
        return "".join(f"U+{ord(ch):04X}" if is_cjk(ch) else ch for ch in str(t))
    return {}, drawable


def _weights(weights, ndim: int, name: str = "weights") -> np.ndarray:
    if hasattr(weights, "detach"):                                 # a torch tensor
        weights = weights.detach().cpu().numpy()
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a numeric array, got {type(weights).__name__}") from None
    while w.ndim > ndim and w.shape[0] == 1:                       # drop leading batch/head axes of size 1
        w = w[0]
    if w.ndim != ndim:
        want = "(L, S)" if ndim == 2 else "(H, L, S)"
        raise ValueError(f"{name}: expected shape {want}, got {w.shape}")
    if 0 in w.shape:
        raise ValueError(f"{name}: expected no empty dimension, got shape {w.shape}")
    return w


def _labels(labels, n: int, name: str, default: str) -> list[str]:
    if labels is None:
        return [f"{default}{i}" for i in range(n)]
    labels = [str(x) for x in labels]
    if len(labels) != n:
        raise ValueError(f"{name}: expected {n} labels (one per {'row' if name == 'row_labels' else 'column'}),"
                         f" got {len(labels)}")
    return labels


def heatmap(weights, row_labels=None, col_labels=None, *, ax=None, title=None, annotate=None,
            cmap: str = "Blues", vmin: float | None = 0.0, vmax: float | None = None, fmt: str = "{:.2f}",
            colorbar: bool = True, xlabel: str | None = "key", ylabel: str | None = "query"):
    """Draw one attention matrix: rows are queries, columns are keys.

    Args:
        weights: (L, S) array (leading axes of size 1 are dropped), e.g. ``trace["weights"].array``.
        row_labels, col_labels: L query and S key labels (tokens); default ``q0 …`` / ``k0 …``.
        ax: a matplotlib Axes to draw on; None makes a new Agg figure (``ax.figure`` to save or show it).
        title: the Axes title.
        annotate: write each value in its cell; None means "when the matrix has ≤ 144 cells".
        cmap, vmin, vmax: colour map and its range (default 0 … the maximum, for weights in [0, 1]).
        fmt: format of an annotation, e.g. ``"{:.2f}"``.
        colorbar: add a colour bar.
        xlabel, ylabel: axis titles.

    Returns:
        The Axes drawn on.
    """
    _matplotlib()
    w = _weights(weights, 2)
    L, S = w.shape
    rows = _labels(row_labels, L, "row_labels", "q")
    cols = _labels(col_labels, S, "col_labels", "k")
    style, drawable = _text_style(rows + cols + [title or ""])
    if ax is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(1.2 + 0.55 * S + (1.0 if colorbar else 0.0), 1.0 + 0.5 * L), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
    finite = w[np.isfinite(w)]
    hi = vmax if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    lo = vmin if vmin is not None else (float(finite.min()) if finite.size else 0.0)
    if hi <= lo:
        hi = lo + 1.0
    im = ax.imshow(w, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(S), [drawable(c) for c in cols], **style)
    ax.set_yticks(range(L), [drawable(r) for r in rows], **style)
    ax.tick_params(axis="x", labelrotation=45 if max(map(len, cols)) > 3 else 0)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        ax.set_title(drawable(title), **style)
    if annotate is None:
        annotate = L * S <= ANNOTATE_MAX_CELLS
    if annotate:
        mid = lo + (hi - lo) / 2
        for i in range(L):
            for j in range(S):
                v = w[i, j]
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8,
                        color="white" if v > mid else "black")
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ax


def heads_grid(weights, row_labels=None, col_labels=None, *, titles=None, ncols: int | None = None,
               suptitle: str | None = None, annotate=None, cmap: str = "Blues", fmt: str = "{:.2f}"):
    """One heatmap per head in a grid, sharing one colour scale (0 … the largest weight).

    Args:
        weights: (H, L, S) attention weights (leading axes of size 1 are dropped).
        row_labels, col_labels: query and key labels, as in :func:`heatmap`.
        titles: H panel titles; default ``head 0 …``.
        ncols: panels per row; default up to 4.
        suptitle: the figure's title.
        annotate: as in :func:`heatmap` (decided per panel).

    Returns:
        The matplotlib Figure (Agg canvas).
    """
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    w = _weights(weights, 3)
    H, L, S = w.shape
    if titles is None:
        titles = [f"head {h}" for h in range(H)]
    titles = [str(t) for t in titles]
    if len(titles) != H:
        raise ValueError(f"titles: expected {H} titles (one per head), got {len(titles)}")
    ncols = min(H, 4) if ncols is None else int(ncols)
    if ncols < 1:
        raise ValueError(f"ncols: expected an integer >= 1, got {ncols}")
    nrows = -(-H // ncols)
    cell = 0.45 if L * S <= ANNOTATE_MAX_CELLS else 0.3
    fig = Figure(figsize=(ncols * (1.4 + cell * S), nrows * (1.2 + cell * L) + (0.4 if suptitle else 0)),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    finite = w[np.isfinite(w)]
    vmax = float(finite.max()) if finite.size else 1.0
    for h in range(nrows * ncols):
        ax = axes[h // ncols][h % ncols]
        if h >= H:
            ax.set_axis_off()
            continue
        heatmap(w[h], row_labels, col_labels, ax=ax, title=titles[h], annotate=annotate, cmap=cmap,
                vmin=0.0, vmax=max(vmax, 1e-12), fmt=fmt, colorbar=False,
                xlabel=None, ylabel=None)
    if suptitle:
        style, drawable = _text_style([suptitle])
        fig.suptitle(drawable(suptitle), **style)
    return fig


def save(fig, path) -> str:
    """Write ``fig`` (a Figure, or an Axes of one) to ``path``; the suffix picks PNG, SVG or PDF.

    Raises ValueError for another suffix and OSError when the file cannot be written.
    """
    path = os.fspath(path)
    fig = getattr(fig, "figure", fig)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"output: expected a file name ending in .png, .svg or .pdf, got {path!r}")
    if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase":
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    with warnings.catch_warnings():
        # Our own warning (no CJK font) already fired; matplotlib's per-glyph warnings would repeat it.
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        with open(path, "wb") as fh:                                # OSError here names the path
            fig.savefig(fh, format=FORMATS[suffix], dpi=150)
    return path
