"""Pictures at any size (issue 11): the heatmap's size, numbers and tick labels follow the matrix's size, memory
and time stay bounded (measured in a subprocess: its peak RSS read back), and writes are atomic."""
import importlib
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("click")

from qkv import viz  # noqa: E402
from qkv.cli import main  # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

hm = importlib.import_module("qkv.viz.heatmap")   # the module (qkv.viz.heatmap is also the function)
ROOT = Path(__file__).resolve().parents[2]
QKV = Path(sys.executable).with_name("qkv")

#: Runs a command as its only child and prints the child's peak RSS (kB) and wall time (s) as the last line.
PEAK = textwrap.dedent("""
    import resource, subprocess, sys, time
    t = time.perf_counter()
    p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    dt = time.perf_counter() - t
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(p.returncode, ru.ru_maxrss, round(min(dt, ru.ru_utime + ru.ru_stime), 2))
""")


def peak(*cmd, timeout=240):
    """(exit code, stdout, stderr, peak RSS in MB, seconds) of ``cmd`` run in a fresh process.

    The seconds are the lesser of its wall time and its CPU time (user + system): on a quiet machine the
    wall time, and when other jobs share the cores (``pytest -n``, CI neighbours) the work it really did,
    which a loaded machine does not inflate (a 46 s wall time was measured for a 20 s job under load 7)."""
    p = subprocess.run([sys.executable, "-c", PEAK, *map(str, cmd)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    *out, last = p.stdout.rstrip("\n").split("\n")
    rc, kb, secs = last.split()
    return int(rc), "\n".join(out), p.stderr, int(kb) / 1024, float(secs)


def png_size(path) -> tuple[int, int]:
    data = Path(path).read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ----------------------------------------------------------------------------------------------- layout
def test_layout_small_matrices_keep_big_cells_numbers_and_every_label():
    lay = viz.layout(3, 3, row_labels=["我", "爱", "吃"], col_labels=["我", "爱", "吃"])
    assert lay["cell"] == hm.MAX_CELL_IN
    assert lay["annotate_pt"] >= hm.MIN_ANNOTATION_PT
    assert lay["row_step"] == lay["col_step"] == 1 and lay["rotate"] == 0


@pytest.mark.parametrize("n", [50, 100, 300, 1024, 4096])
def test_layout_large_matrices_are_bounded(n):
    lay = viz.layout(n, n)
    assert lay["cell"] * n <= hm.MAX_SIDE_IN + 1e-9                   # the matrix fits in 12 in
    assert n / lay["row_step"] <= hm.MAX_TICKS + 1 and n / lay["col_step"] <= hm.MAX_TICKS + 1
    # rows labelled at least a font height apart: no overlap
    assert lay["row_step"] * lay["cell"] * 72 >= 1.2 * lay["tick_pt"]
    if n >= 100:
        assert lay["annotate_pt"] == 0                                 # numbers would not be legible
        assert lay["interpolation"] == "antialiased" or lay["cell"] * hm.DPI >= 3


def test_long_rows_are_coloured_by_square_root():
    assert not viz.layout(48, 48)["sqrt"] and viz.layout(49, 10)["sqrt"]
    ax = viz.heatmap(np.full((60, 60), 1 / 60))
    assert type(ax.images[0].norm).__name__ == "PowerNorm" and ax.images[0].norm.gamma == 0.5
    assert ax.figure.axes[-1].get_ylabel() == "√ scale"                  # the colour bar says so
    assert type(viz.heatmap(np.eye(3)).images[0].norm).__name__ == "Normalize"
    assert viz.heads_grid(np.full((2, 60, 60), 1 / 60), suptitle="x")._suptitle.get_text() == "x (colours: √ scale)"


def test_numbers_only_where_legible_and_labels_thinned():
    w = np.full((200, 200), 1 / 200)
    labels = [f"t{i}" for i in range(200)]
    ax = viz.heatmap(w, labels, labels)
    assert len(ax.texts) == 0
    shown = [t.get_text() for t in ax.get_yticklabels()]
    assert 2 <= len(shown) <= hm.MAX_TICKS + 1 and shown[0] == "t0"
    assert set(shown) <= set(labels)
    assert "1 label in" in ax.get_ylabel()
    fw, fh = ax.figure.get_size_inches()
    assert fw * hm.DPI < 2600 and fh * hm.DPI < 2600                  # not 88 px a token
    with pytest.warns(UserWarning, match="too many to write a number"):
        assert len(viz.heatmap(np.full((120, 120), 1 / 120), annotate=True).texts) == 0


def test_long_labels_are_shortened():
    long = "x" * 100
    ax = viz.heatmap(np.eye(2), [long, "b"], ["a", long])
    assert all(len(t.get_text()) <= hm.MAX_LABEL_CHARS for t in ax.get_yticklabels() + ax.get_xticklabels())


def test_grid_of_large_panels_labels_the_outer_edges_only():
    w = np.full((6, 40, 40), 1 / 40)
    fig = viz.heads_grid(w)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 6
    with_rows = [i for i, ax in enumerate(panels) if ax.get_yticklabels()]
    with_cols = [i for i, ax in enumerate(panels) if ax.get_xticklabels()]
    assert with_rows == [0, 4]                                          # the first column of 4
    assert with_cols == [2, 3, 4, 5]                                    # nothing below them


# ----------------------------------------------------------------------------------------------- atomic writes
def _boom(fig, fh, **kwargs):
    fh.write(b"\x89PNG half a picture")
    raise MemoryError


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    ax = viz.heatmap(np.eye(3))
    monkeypatch.setattr(type(ax.figure), "savefig", _boom)
    target = tmp_path / "w.png"
    with pytest.raises(MemoryError):
        viz.save(ax, target)
    assert list(tmp_path.iterdir()) == []                               # no 0-byte file, no temporary
    target.write_bytes(b"the old picture")
    with pytest.raises(MemoryError):
        viz.save(ax, target)
    assert target.read_bytes() == b"the old picture"                   # the old file is kept whole
    assert [p.name for p in tmp_path.iterdir()] == ["w.png"]


def test_save_gives_the_usual_permissions(tmp_path):
    path = tmp_path / "w.png"
    viz.save(viz.heatmap(np.eye(2)), path)
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["w.png"]


def test_cli_failure_leaves_no_file(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", _boom)
    out = tmp_path / "h.png"
    code = main(["heatmap", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "out of memory" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------- memory and time
def _big_example(path: Path, L: int = 1024, D: int = 8) -> Path:
    rng = np.random.default_rng(0)
    X = np.round(rng.normal(size=(L, D)), 3)
    W = [np.round(rng.normal(size=(D, D)) * 0.3, 3) for _ in range(3)]
    path.write_text(json.dumps({"title": f"{L} tokens", "tokens": [f"t{i}" for i in range(L)], "X": X.tolist(),
                                "W_Q": W[0].tolist(), "W_K": W[1].tolist(), "W_V": W[2].tolist()}))
    return path


def test_heatmap_of_1024_tokens_is_bounded(tmp_path):
    src = _big_example(tmp_path / "big.json")
    out = tmp_path / "big.png"
    rc, stdout, err, mb, secs = peak(QKV, "heatmap", src, "-o", out)
    assert rc == 0, err
    print(f"1,024-token heatmap: peak RSS {mb:.0f} MB, {secs:.1f} s")
    assert mb < 1024 and secs < 30
    w, h = png_size(out)
    assert w <= 2600 and h <= 2600


# ----------------------------------------------------------------------------------------------- explain at any size
examples = importlib.import_module("qkv.explain.examples")
render_mod = importlib.import_module("qkv.explain.render")


def _mid_example(L=40, D=4, **extra):
    rng = np.random.default_rng(1)
    doc = {"tokens": [f"t{i}" for i in range(L)], "X": np.round(rng.normal(size=(L, D)), 2).tolist(),
           **{k: np.round(rng.uniform(-1, 1, (D, 4)), 1).tolist() for k in ("W_Q", "W_K", "W_V")}}
    doc.update(extra)
    return examples.from_dict(doc, name="mid")


VARIANTS = [{}, {"mask": "causal"}, {"heads": 2}, {"heads": 2, "alibi": True, "mask": "causal"},
            {"rope": {"theta": 10000}}, {"softcap": 5, "window": 3}, {"documents": [10, 30], "sinks": 1},
            {"sink_logits": [0.5]}, {"heads": 2, "sink_logits": [0.5, -1.0], "prefix": 4}]


@pytest.mark.parametrize("extra", VARIANTS, ids=lambda v: ",".join(v) or "plain")
def test_row_blocks_write_the_same_document_as_the_whole_trace(extra):
    """run_rows (blocks of 7 query rows, only the shown rows kept) → the same text as run() on every row."""
    w = _mid_example(**extra)
    L = w.n_queries
    edges = [0, 1, 2, L - 3, L - 2, L - 1]
    whole = render_mod.render(examples.run(w), tokens=w.tokens)
    rows = examples.run_rows(w, edges, block_cells=7 * L)
    assert render_mod.render(rows, tokens=w.tokens) == whole
    assert "the first 3 and last 3 of 40 rows" in whole
    assert rows["weights"].array.shape[-2] == 6 and render_mod.full_shape(rows["weights"])[-2] == L
    H = w.heads
    one = examples.run_rows(w, [17], block_cells=5 * L)
    assert (render_mod.explain_query(one, 17, head=H - 1, tokens=w.tokens)
            == render_mod.explain_query(examples.run(w), 17, head=H - 1, tokens=w.tokens))
    with pytest.raises(ValueError, match="holds only rows"):
        render_mod.explain_query(one, 3, tokens=w.tokens)


def test_row_blocks_of_every_builtin_example():
    for name in examples.builtin_names():
        w = examples.load_example(name)
        tokens = list(w.tokens) if w.tokens_given else None
        assert (render_mod.render(examples.run_rows(w, range(w.n_queries), block_cells=2 * w.n_keys), tokens=tokens)
                == render_mod.render(examples.run(w), tokens=tokens)), name


def test_row_blocks_from_q_and_k_and_from_scores():
    rng = np.random.default_rng(2)
    for doc in ({"Q": rng.normal(size=(30, 3)).round(2).tolist(), "K": rng.normal(size=(20, 3)).round(2).tolist(),
                 "V": rng.normal(size=(20, 2)).round(2).tolist()},
                {"scores": rng.normal(size=(30, 12)).round(2).tolist(), "d_k": 4, "mask": "causal"}):
        w = examples.from_dict(doc, name="x")
        rows = examples.run_rows(w, [0, 1, 2, 27, 28, 29], block_cells=50)
        assert render_mod.render(rows) == render_mod.render(examples.run(w))


def _big_explain_file(path: Path, L: int = 10_000) -> Path:
    rng = np.random.default_rng(0)
    X = np.round(rng.normal(size=(L, 4)), 2)
    W = [np.round(rng.uniform(-1, 1, size=(4, 3)), 1) for _ in range(3)]
    path.write_text(json.dumps({"title": f"{L} tokens", "tokens": [f"w{i}" for i in range(L)], "X": X.tolist(),
                                "W_Q": W[0].tolist(), "W_K": W[1].tolist(), "W_V": W[2].tolist()}))
    return path


def test_explain_of_10000_tokens_is_bounded(tmp_path):
    src = _big_explain_file(tmp_path / "big.json")
    rc, out, err, mb, secs = peak(QKV, "explain", src)
    assert rc == 0, err
    print(f"qkv explain, 10,000 tokens: peak RSS {mb:.0f} MB, {secs:.1f} s")
    assert mb < 1024 and secs < 60
    assert "(10000, 3) · (10000, 3)ᵀ → (10000, 10000)" in out
    assert "the first 3 and last 3 of 10000 rows; the first 3 and last 3 of 10000 columns; 100000000 values" in out
    assert f"qkv explain {src} --query ROW" in out                     # how to see one query whole
    assert len(out) < 40_000                                            # no 10,000-token line either
    rc, out, err, mb, secs = peak(QKV, "explain", src, "--query", "w5000")
    assert rc == 0, err
    print(f"qkv explain --query w5000, 10,000 tokens: peak RSS {mb:.0f} MB, {secs:.1f} s")
    assert mb < 1024 and secs < 60
    assert "Query w5000: its whole calculation" in out and "the other 9992 keys have total weight" in out
