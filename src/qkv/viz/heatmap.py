"""Attention heatmaps with matplotlib (the ``viz`` extra), drawn off-screen with the Agg backend.

    heatmap(weights, row_labels, col_labels)    one (L, S) matrix on one Axes; queries are rows, keys columns
    heads_grid(weights, row_labels, col_labels) (H, L, S): one small heatmap per head, in a grid
    save(fig, path)                             PNG, SVG or PDF, chosen by the file name's suffix

Labels in Chinese (or Japanese, Korean) need a font that has those characters: :func:`cjk_font` looks for
one among the installed fonts (Debian's ``fonts-noto-cjk`` provides Noto Sans CJK). When there is none, qkv
warns once with the install hint and writes such characters as ``U+6211`` instead of drawing empty boxes.
matplotlib is imported inside the functions, so ``import qkv.viz`` costs nothing without it.

Any size: the figure's size, the numbers in the cells and the tick labels are chosen from the matrix's size
(:func:`layout`). A cell is at most 0.55 in wide and a picture at most 12 in (a grid's panel 4 in), so a
1,024-token matrix is an 1,800-pixel PNG, not a 90,000-pixel one; numbers are written in the cells only where
they fit at a legible size (6 pt or more); tick labels are thinned to every k-th token so they do not overlap.
:func:`save` writes a temporary file in the target's folder and renames it: a failure (a full disk, no memory)
leaves no empty or half-written file behind.
"""
from __future__ import annotations

import functools
import math
import os
import warnings

import numpy as np

from qkv._files import atomic_write, output_kind

#: CJK families to prefer, best first; any other installed family whose name contains "CJK" comes next.
CJK_FAMILIES = (
    "Noto Sans CJK SC", "Noto Sans CJK TC", "Noto Sans CJK JP", "Noto Sans CJK KR", "Noto Sans CJK HK",
    "Source Han Sans SC", "Source Han Sans CN", "Noto Sans SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
    "Droid Sans Fallback", "AR PL UMing CN", "AR PL UKai CN", "Noto Serif CJK SC", "SimHei",
    "Microsoft YaHei", "PingFang SC", "Heiti SC", "Hiragino Sans GB", "Arial Unicode MS",
)
INSTALL_HINT = "apt-get install fonts-noto-cjk"
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
#: Pixels per inch of a written PNG.
DPI = 150
#: The largest cell (inches): small matrices are drawn at this size, larger ones shrink to fit.
MAX_CELL_IN = 0.55
#: The longest side of one heatmap's matrix (inches; 1,800 px at 150 dpi) and of one panel in a grid.
MAX_SIDE_IN = 12.0
MAX_PANEL_IN = 4.0
#: Beyond this many rows or columns the colours follow √weight (matplotlib's PowerNorm(0.5)): in a long row most
#: weights are near 1/S and a linear scale shows only the few largest.
SQRT_BEYOND = 48
#: Numbers are written in the cells only at this font size (points) or more; the largest size used is 8.
MIN_ANNOTATION_PT = 6.0
MAX_ANNOTATION_PT = 8.0
#: ``annotate=True`` writes at most this many numbers (beyond it they could not be read: a warning instead).
MAX_ANNOTATIONS = 10_000
#: Tick labels: their font size range (points), and the longest label kept (longer ones end in "…").
MIN_TICK_PT, MAX_TICK_PT = 6.0, 10.0
MAX_LABEL_CHARS = 16
#: At most this many tick labels on an axis (more could not be read, and each costs drawing time).
MAX_TICKS = 48
MAX_PANEL_TICKS = 24
#: A digit is about this wide, in ems, in DejaVu Sans (matplotlib's default font); a CJK character is 1 em.
_DIGIT_EM = 0.64

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
        w = np.asarray(weights)
        if w.dtype not in (np.float32, np.float64):                 # float32 stays: no 8-byte copy of a large map
            w = w.astype(np.float64)
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


def _text_width_em(text: str) -> float:
    """Roughly how wide ``text`` is, in ems: wide (CJK) characters 1, others about a digit's width."""
    return sum(1.0 if is_cjk(ch) else _DIGIT_EM for ch in text)


def _short(label: str) -> str:
    return label if len(label) <= MAX_LABEL_CHARS else label[:MAX_LABEL_CHARS - 1] + "…"


def layout(L: int, S: int, *, max_side: float = MAX_SIDE_IN, max_cell: float = MAX_CELL_IN,
           cell: float | None = None, row_labels=None, col_labels=None, sample: str = "0.00",
           max_ticks: int | None = None) -> dict:
    """How an (L, S) heatmap is drawn at its size: what :func:`heatmap` and :func:`heads_grid` follow.

    Returns a dict:
        cell          the side of one cell in inches: ``min(max_cell, max_side / max(L, S))`` (or ``cell``)
        annotate_pt   the font size of the numbers in the cells (points) — 0 when they would be smaller than
                      ``MIN_ANNOTATION_PT`` (not legible), so none are written by default
        tick_pt       the font size of the tick labels
        row_step, col_step   every k-th row / column is labelled (1: all), so that labels do not overlap and
                      there are at most ``MAX_TICKS`` (48) of them
        rotate        the column labels' rotation (0, 45 or 90 degrees)
        interpolation "nearest" while a cell is at least 3 pixels, else "antialiased" (no moiré)
        sqrt          colours by √weight (more than SQRT_BEYOND rows or columns)
    """
    if cell is None:
        cell = min(max_cell, max_side / max(L, S, 1))
    max_ticks = MAX_TICKS if max_ticks is None else max_ticks
    pt = cell * 72.0                                                  # a cell's side in points
    width_em = _text_width_em(sample)
    annotate_pt = min(MAX_ANNOTATION_PT, 0.85 * pt / max(width_em, 1e-9), pt / 1.4)
    if annotate_pt < MIN_ANNOTATION_PT:
        annotate_pt = 0.0
    tick_pt = max(MIN_TICK_PT, min(MAX_TICK_PT, 0.8 * pt))
    cols = [_short(c) for c in (col_labels or [])]
    row_step = max(1, math.ceil(1.25 * tick_pt / pt), math.ceil(L / max_ticks))
    widest = max((_text_width_em(c) for c in cols), default=2 * _DIGIT_EM) * tick_pt
    if widest <= 0.9 * pt and (not cols or max(map(len, cols)) <= 3):
        rotate, col_step = 0, 1
    elif S <= 24 and widest <= 4 * pt:
        rotate, col_step = 45, max(1, math.ceil(0.9 * tick_pt / pt))
    else:
        rotate, col_step = 90, max(1, math.ceil(1.25 * tick_pt / pt))
    col_step = max(col_step, math.ceil(S / max_ticks))
    return {"cell": cell, "annotate_pt": annotate_pt, "tick_pt": tick_pt, "row_step": row_step,
            "col_step": col_step, "rotate": rotate,
            "interpolation": "nearest" if cell * DPI >= 3 else "antialiased", "sqrt": max(L, S) > SQRT_BEYOND}


def _ticks(n: int, step: int) -> list[int]:
    """Every ``step``-th index, always including the last one when there is room for it."""
    ticks = list(range(0, n, step))
    if step > 1 and ticks and n - 1 - ticks[-1] >= step / 2:
        ticks.append(n - 1)
    return ticks


def _finite_range(w: np.ndarray) -> tuple[float, float] | None:
    """The smallest and largest finite value of ``w`` (None when there is none), without copying them out."""
    ok = np.isfinite(w)
    if not ok.any():
        return None
    return float(np.min(w, where=ok, initial=np.inf)), float(np.max(w, where=ok, initial=-np.inf))


def _pooled(w: np.ndarray, px_per_cell: float) -> tuple[np.ndarray, int]:
    """``w`` averaged over k × k blocks when k whole cells fit in a pixel (the last blocks may be partial), and
    k: matplotlib then resamples a picture of about the image's own size, not the whole matrix (its colour
    stage alone takes 32 bytes a cell); the picture is what its antialiasing would show."""
    k = int(1.0 / px_per_cell) if px_per_cell > 0 else 1
    if k < 2:
        return w, 1
    L, S = w.shape
    r0, c0 = np.arange(0, L, k), np.arange(0, S, k)
    rows = np.add.reduceat(w, r0, axis=0) / np.diff(np.r_[r0, L]).astype(w.dtype)[:, None]
    return np.add.reduceat(rows, c0, axis=1) / np.diff(np.r_[c0, S]).astype(w.dtype)[None, :], k


def heatmap(weights, row_labels=None, col_labels=None, *, ax=None, title=None, annotate=None,
            cmap: str = "Blues", vmin: float | None = 0.0, vmax: float | None = None, fmt: str = "{:.2f}",
            colorbar: bool = True, xlabel: str | None = "key", ylabel: str | None = "query", _layout=None,
            _tick_rows: bool = True, _tick_cols: bool = True):
    """Draw one attention matrix: rows are queries, columns are keys. Any size (see :func:`layout`).

    Args:
        weights: (L, S) array (leading axes of size 1 are dropped), e.g. ``trace["weights"].array``.
        row_labels, col_labels: L query and S key labels (tokens); default ``q0 …`` / ``k0 …``. Thinned to every
            k-th one when they would overlap; longer than 16 characters end in "…".
        ax: a matplotlib Axes to draw on; None makes a new Agg figure sized for the matrix (cells of at most
            0.55 in, the matrix at most 12 in; ``ax.figure`` to save or show it).
        title: the Axes title.
        annotate: write each value in its cell; None means "where the numbers are legible at the cell size"
            (6 pt or more: about 50 × 50 cells at most in a new figure); True forces them (up to 10,000 cells,
            else a warning and none); False never.
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
    lo, hi = _color_range(w, vmin, vmax)
    sample = max((fmt.format(v) for v in (lo, hi, -abs(hi))), key=len)
    lay = _layout if _layout is not None else _layout_for(ax, L, S, rows, cols, sample)
    rstep, cstep = lay["row_step"], lay["col_step"]
    rticks = _ticks(L, rstep) if _tick_rows else []                 # a grid labels its outer panels only
    cticks = _ticks(S, cstep) if _tick_cols else []
    shown = [rows[i] for i in rticks] + [cols[j] for j in cticks]
    style, drawable = _text_style(shown + [title or ""])
    if ax is None:
        ax = _new_axes(lay, rows, rticks, L, S, colorbar)
    size = lay["annotate_pt"]
    if annotate is None:
        annotate = size > 0
    elif annotate and L * S > MAX_ANNOTATIONS:
        warnings.warn(f"annotate: {L}×{S} = {L * S} cells are too many to write a number in each (at most "
                      f"{MAX_ANNOTATIONS}); drawing the colours only", UserWarning, stacklevel=2)
        annotate = False
    im = _draw_image(ax, w, lay, annotate, lo, hi, cmap)
    _draw_labels(ax, lay, rows, cols, rticks, cticks, style, drawable)
    if xlabel:
        ax.set_xlabel(xlabel + (f" (1 label in {cstep})" if cstep > 1 else ""))
    if ylabel:
        ax.set_ylabel(ylabel + (f" (1 label in {rstep})" if rstep > 1 else ""))
    if title:
        ax.set_title(drawable(title), **style)
    if annotate:
        _write_numbers(ax, w, fmt, size or max(2.0, min(MAX_ANNOTATION_PT, lay["cell"] * 72.0 / 1.4)), lo, hi)
    if colorbar:
        cb = ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        if lay.get("sqrt") and lo >= 0:
            cb.set_label("√ scale")
    return ax


def _color_range(w: np.ndarray, vmin: float | None, vmax: float | None) -> tuple[float, float]:
    """The colour range (lo, hi): vmin / vmax where given, else the finite values' (0 … 1 when none); hi > lo."""
    span = _finite_range(w)
    hi = vmax if vmax is not None else (span[1] if span else 1.0)
    lo = vmin if vmin is not None else (span[0] if span else 0.0)
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def _layout_for(ax, L: int, S: int, rows: list[str], cols: list[str], sample: str) -> dict:
    """:func:`layout` for a new figure, or for ``ax`` (the Axes' own size decides)."""
    cell = None
    if ax is not None:                                            # the Axes' own size decides
        fw, fh = ax.figure.get_size_inches()
        box = ax.get_position()
        cell = max(min(box.width * fw / S, box.height * fh / L), 1e-3)
    return layout(L, S, cell=cell, row_labels=rows, col_labels=cols, sample=sample)


def _new_axes(lay: dict, rows: list[str], rticks: list[int], L: int, S: int, colorbar: bool):
    """A new Agg figure sized for the matrix, its labels and colour bar; its one Axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = lay["cell"]
    label_in = max((_text_width_em(_short(r)) for r in (rows[i] for i in rticks)), default=1.0) \
        * lay["tick_pt"] / 72.0
    fig = Figure(figsize=(0.9 + label_in + c * S + (1.0 if colorbar else 0.0),
                          1.0 + (0.6 if lay["rotate"] else 0.3) + c * L), layout="constrained")
    FigureCanvasAgg(fig)
    return fig.add_subplot()


def _draw_image(ax, w: np.ndarray, lay: dict, annotate: bool, lo: float, hi: float, cmap: str):
    """The colours of ``w`` on ``ax`` (pooled when cells are smaller than a pixel and not annotated); the image."""
    L, S = w.shape
    img, k = (w, 1) if annotate else _pooled(w, lay["cell"] * DPI)
    norm = {"vmin": lo, "vmax": hi}
    if lay.get("sqrt") and lo >= 0:
        from matplotlib.colors import PowerNorm
        norm = {"norm": PowerNorm(0.5, vmin=lo, vmax=hi)}
    if lay["interpolation"] != "nearest":                             # resample the numbers, then colour them:
        norm["interpolation_stage"] = "data"                          # not an RGBA copy of every cell (32 B each)
    im = ax.imshow(img, cmap=cmap, aspect="auto", interpolation=lay["interpolation"], **norm,
                   **({} if k == 1 else {"extent": (-0.5, img.shape[1] * k - 0.5, img.shape[0] * k - 0.5, -0.5)}))
    if k > 1:                                                          # partial last blocks: cut at the matrix
        ax.set_xlim(-0.5, S - 0.5)
        ax.set_ylim(L - 0.5, -0.5)
    return im


def _draw_labels(ax, lay: dict, rows: list[str], cols: list[str], rticks: list[int], cticks: list[int],
                 style: dict, drawable) -> None:
    """The tick labels (shortened, drawable in the chosen font), rotated as the layout says."""
    tick_style = dict(style, fontsize=lay["tick_pt"])
    ax.set_xticks(cticks, [drawable(_short(cols[j])) for j in cticks], **tick_style)
    ax.set_yticks(rticks, [drawable(_short(rows[i])) for i in rticks], **tick_style)
    ax.tick_params(axis="x", labelrotation=lay["rotate"])
    if lay["rotate"] == 45:
        for lab in ax.get_xticklabels():
            lab.set_horizontalalignment("right")
            lab.set_rotation_mode("anchor")


def _write_numbers(ax, w: np.ndarray, fmt: str, size: float, lo: float, hi: float) -> None:
    """Each value of ``w`` written in its cell, white on the darker half of the colour range."""
    L, S = w.shape
    mid = lo + (hi - lo) / 2
    for i in range(L):
        for j in range(S):
            v = w[i, j]
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=size,
                    color="white" if v > mid else "black")


def heads_grid(weights, row_labels=None, col_labels=None, *, titles=None, ncols: int | None = None,
               suptitle: str | None = None, annotate=None, cmap: str = "Blues", fmt: str = "{:.2f}"):
    """One heatmap per head in a grid, sharing one colour scale (0 … the largest weight). Any size: each
    panel's matrix is at most 4 in (cells of at most 0.45 in), numbers and tick labels as :func:`layout` says.

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
    rows = _labels(row_labels, L, "row_labels", "q")
    cols = _labels(col_labels, S, "col_labels", "k")
    span = _finite_range(w)
    vmax = max(span[1] if span else 1.0, 1e-12)
    lay = layout(L, S, max_side=MAX_PANEL_IN, max_cell=0.45, row_labels=rows, col_labels=cols,
                 sample=fmt.format(vmax), max_ticks=MAX_PANEL_TICKS)
    c = lay["cell"]
    big = max(L, S) > 16                       # small panels keep their own labels; large ones label the edges
    label_in = max((_text_width_em(_short(r)) for r in rows[::lay["row_step"]]), default=1.0) * lay["tick_pt"] / 72
    fig = Figure(figsize=(ncols * (0.5 + label_in + c * S), nrows * (0.9 + (0.5 if lay["rotate"] else 0.2) + c * L)
                          + (0.4 if suptitle else 0)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for h in range(nrows * ncols):
        ax = axes[h // ncols][h % ncols]
        if h >= H:
            ax.set_axis_off()
            continue
        last_row = h + ncols >= H                                     # nothing drawn below this panel
        heatmap(w[h], rows, cols, ax=ax, title=titles[h], annotate=annotate, cmap=cmap,
                vmin=0.0, vmax=vmax, fmt=fmt, colorbar=False, xlabel=None, ylabel=None, _layout=lay,
                _tick_rows=not big or h % ncols == 0, _tick_cols=not big or last_row)
    if suptitle or lay.get("sqrt"):
        text = (suptitle or "") + (" (colours: √ scale)" if lay.get("sqrt") else "")
        style, drawable = _text_style([text])
        fig.suptitle(drawable(text.strip()), **style)
    return fig


def save(fig, path) -> str:
    """Write ``fig`` (a Figure, or an Axes of one) to ``path``; the suffix picks PNG, SVG or PDF (PNG for ``-``,
    standard output, and a FIFO or device whose name has none of them).

    The file is written whole or not at all (:func:`atomic_write`). Raises ValueError for another suffix and
    OSError when the file cannot be written.
    """
    path = os.fspath(path)
    fig = getattr(fig, "figure", fig)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS and output_kind(path) != "file":
        suffix = ".png"                            # standard output, a pipe or a device: PNG unless named
    if suffix not in FORMATS:
        raise ValueError(f"output: expected a file name ending in .png, .svg or .pdf, got {path!r}")
    if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase":
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    with warnings.catch_warnings():
        # Our own warning (no CJK font) already fired; matplotlib's per-glyph warnings would repeat it.
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        kw = {}
        if suffix == ".png":                       # a large picture: zlib's fastest level (3× faster, ~25% bigger)
            w_in, h_in = fig.get_size_inches()
            kw["pil_kwargs"] = {"compress_level": 1 if w_in * h_in * DPI * DPI > 2e6 else 6}
        with atomic_write(path, "wb") as fh:                        # OSError here names the path
            fig.savefig(fh, format=FORMATS[suffix], dpi=DPI, **kw)
    return path
