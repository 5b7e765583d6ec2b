"""qkv heatmap's memory is a few copies of the (L, S) float32 weights (issue 26): a 5,000-token example took
2.3 GB (about 90 bytes a weight: the whole float64 trace, a float64 copy, and matplotlib's colour stage over
every cell); the weights now come block by block of query rows in float32, and a matrix of cells under a pixel
is averaged to about the picture's size before matplotlib resamples it."""
import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("click")

from qkv import viz  # noqa: E402
from qkv.explain import examples as ex  # noqa: E402
from qkv.explain.weights import attention_weights  # noqa: E402
from test_viz_scale import QKV, peak, png_size  # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow


def _example(T: int, seed: int = 0, **extra) -> dict:
    rng = np.random.default_rng(seed)
    return {"title": f"{T} tokens", "tokens": [f"t{i}" for i in range(T)],
            "X": rng.standard_normal((T, 8)).round(3).tolist(),
            **{w: rng.standard_normal((8, 8)).round(3).tolist() for w in ("W_Q", "W_K", "W_V")}, **extra}


def test_heatmap_of_5000_tokens_takes_a_few_copies_of_its_weights(tmp_path):
    src = tmp_path / "t5000.json"
    src.write_text(json.dumps(_example(5000)))
    out = tmp_path / "h.png"
    rc, _, err, mb, secs = peak(QKV, "heatmap", src, "-o", out)
    assert rc == 0, err
    weights_mb = 5000 * 5000 * 4 / 2**20                                   # 95 MB in float32
    print(f"5,000-token heatmap: peak RSS {mb:.0f} MB, {secs:.1f} s")
    assert mb < 150 + 3 * weights_mb, mb                                  # Python + matplotlib, and 3 copies
    w, h = png_size(out)
    assert w <= 2600 and h <= 2600


@pytest.mark.parametrize("extra", [{}, {"mask": "causal", "heads": 2}])
def test_the_streamed_weights_are_runs(extra):
    worked = ex.from_dict(_example(1100, seed=1, **extra))
    assert ex.is_large(worked)
    got = attention_weights(worked)
    want = np.asarray(ex.run(worked)["weights"].array)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def test_an_overflow_is_the_error_run_raises():
    doc = _example(1100, seed=2)
    doc["X"][5][0] = 1e200
    worked = ex.from_dict(doc)
    with pytest.raises(ex.WorkedExampleError) as want:
        ex.run(worked)
    with pytest.raises(ex.WorkedExampleError) as got:
        attention_weights(worked)
    assert str(got.value) == str(want.value)


def test_pooled_picture_is_the_mean_of_its_cells():
    import importlib
    hm = importlib.import_module("qkv.viz.heatmap")
    w = np.random.default_rng(3).random((7, 5)).astype(np.float32)
    img, k = hm._pooled(w, 0.4)                                           # 2 cells a pixel
    assert k == 2 and img.shape == (4, 3) and img.dtype == np.float32
    np.testing.assert_allclose(img[0, 0], w[:2, :2].mean(), rtol=1e-6)
    np.testing.assert_allclose(img[3, 2], w[6:, 4:].mean(), rtol=1e-6)   # partial last blocks
    assert hm._pooled(w, 0.6)[1] == 1
    ax = viz.heatmap(np.full((5000, 4000), 1 / 4000, np.float32))
    assert ax.images[0].get_array().shape == (2500, 2000) and ax.get_ylim() == (4999.5, -0.5)
    assert ax.get_xlim() == (-0.5, 3999.5) and ax.images[0].get_interpolation_stage() == "data"
