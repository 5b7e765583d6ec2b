"""qkv.viz heatmaps: the picture shows the trace's weights, labels are tokens, CJK labels get a CJK font."""
import importlib
import warnings

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import qkv  # noqa: E402
from qkv import viz  # noqa: E402
hm = importlib.import_module("qkv.viz.heatmap")   # the module (qkv.viz.heatmap is also the function)

TOKENS = ["我", "爱", "吃"]
X = np.array([[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]])
W_Q = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-"}


def seed_weights():
    t = qkv.Trace()
    qkv.attention(X, W_Q, W_Q + 0.1, W_Q + 0.2, trace=t)
    return t["weights"].array


@pytest.fixture(autouse=True)
def fresh_warning_state(monkeypatch):
    monkeypatch.setattr(hm, "_warned_no_cjk", False)


def test_heatmap_draws_the_weights_with_token_labels():
    w = seed_weights()
    ax = viz.heatmap(w, TOKENS, TOKENS, title="seed 003")
    np.testing.assert_array_equal(ax.images[0].get_array(), w)
    assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    # Small matrix: every cell annotated with its value, row-major.
    texts = [t.get_text() for t in ax.texts]
    assert texts == [f"{v:.2f}" for v in w.ravel()]
    assert ax.get_xlabel() == "key" and ax.get_ylabel() == "query"


def test_annotation_is_automatic_by_size_and_can_be_forced():
    # Numbers where they are legible at the cell size (issue 11: chosen from the size, not a cell count).
    assert len(viz.heatmap(np.full((13, 12), 1 / 12)).texts) == 13 * 12
    big = np.full((80, 80), 1 / 80)
    assert len(viz.heatmap(big).texts) == 0
    assert len(viz.heatmap(big, annotate=True).texts) == 80 * 80
    assert len(viz.heatmap(seed_weights(), annotate=False).texts) == 0


def test_default_labels_and_leading_axes_dropped():
    ax = viz.heatmap(seed_weights()[None, None])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["k0", "k1", "k2"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["q0", "q1", "q2"]


def test_cjk_labels_resolve_to_a_font_that_has_the_characters():
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    family = viz.cjk_font()
    assert family is not None, "fonts-noto-cjk is installed by `make test`; no CJK font was found"
    ax = viz.heatmap(seed_weights(), TOKENS, TOKENS, title="我 爱 吃")
    for label in ax.get_xticklabels() + ax.get_yticklabels() + [ax.title]:
        assert label.get_fontfamily()[0] == family
        path = font_manager.findfont(label.get_fontproperties(), fallback_to_default=False)
        font = FT2Font(path)
        for ch in label.get_text().replace(" ", ""):
            assert font.get_char_index(ord(ch)) != 0, f"{path} has no glyph for {ch!r}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                              # no "Glyph … missing" warning either
        ax.figure.canvas.draw()


def test_latin_labels_keep_the_default_font():
    ax = viz.heatmap(seed_weights(), ["I", "love", "eat"], ["I", "love", "eat"])
    assert viz.cjk_font() not in ax.get_xticklabels()[0].get_fontfamily()


def test_no_cjk_font_warns_once_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(hm, "cjk_font", lambda: None)
    with pytest.warns(UserWarning, match="apt-get install fonts-noto-cjk"):
        ax = viz.heatmap(seed_weights(), TOKENS, TOKENS)
    # Not empty boxes: the characters are written as their code points.
    assert [t.get_text() for t in ax.get_xticklabels()] == ["U+6211", "U+7231", "U+5403"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        viz.heatmap(seed_weights(), TOKENS, TOKENS)                 # once: the second call is silent


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_save_by_suffix(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    viz.save(viz.heatmap(seed_weights(), TOKENS, TOKENS), path)
    data = path.read_bytes()
    if suffix == ".svg":
        assert data.lstrip().startswith(b"<?xml") and b"<svg" in data[:1000]
    else:
        assert data.startswith(SIGNATURES[suffix])


def test_save_rejects_other_suffixes_and_unwritable_paths(tmp_path):
    ax = viz.heatmap(seed_weights())
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.pdf"):
        viz.save(ax, tmp_path / "w.jpg")
    with pytest.raises(OSError):
        viz.save(ax, tmp_path / "missing-folder" / "w.png")


def test_heads_grid_one_panel_per_head_on_one_scale():
    rng = np.random.default_rng(0)
    D, H = 4, 2
    mha = qkv.MultiHeadAttention(D, H, bias=False, dtype=np.float64, seed=0)
    t = qkv.Trace()
    mha(rng.normal(size=(5, D)), trace=t)
    w = t["weights"].array                                          # (1, H, 5, 5)
    fig = viz.heads_grid(w, suptitle="two heads")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == H
    for h, ax in enumerate(panels):
        np.testing.assert_array_equal(ax.images[0].get_array(), w[0, h])
        assert ax.get_title() == f"head {h}"
        assert ax.images[0].get_clim() == (0.0, w.max())
    assert fig._suptitle.get_text() == "two heads"
    fig5 = viz.heads_grid(np.stack([w[0, 0]] * 5))
    assert len([ax for ax in fig5.axes if ax.images]) == 5 and len(fig5.axes) == 8   # 2 rows of 4, 3 blank


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"weights: expected shape \(L, S\)"):
        viz.heatmap(np.ones(3))
    with pytest.raises(ValueError, match="row_labels: expected 3 labels"):
        viz.heatmap(seed_weights(), ["a", "b"])
    with pytest.raises(ValueError, match=r"weights: expected shape \(H, L, S\)"):
        viz.heads_grid(np.ones((2, 3)))
    with pytest.raises(TypeError, match="weights: expected a numeric array"):
        viz.heatmap([["a", "b"]])
