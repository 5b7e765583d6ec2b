"""The tests of tests/unit/test_viz_scale.py that need a model package (MiniLM, SmolLM2) or its readers."""

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("click")
from test_viz_scale import PEAK, QKV, ROOT, peak  # noqa: E402,F401  (its helpers, shared)


@pytest.mark.model
def test_minilm_grid_of_512_tokens_is_bounded(tmp_path):
    try:
        from qkv.models import load_bert
        load_bert()
    except ImportError as exc:
        pytest.skip(f"no model: {exc}")
    words = "the cat sat on a mat and looked at birds flying over old houses near the river".split()
    text = " ".join(words[i % len(words)] for i in range(600))            # more than 512 tokens
    out = tmp_path / "grid.svg"
    rc, stdout, err, mb, secs = peak(QKV, "heatmap", "--text", text, "--layer", "2", "-o", out)
    assert rc == 0, err
    print(f"MiniLM 12-head grid, 512 tokens: peak RSS {mb:.0f} MB, {secs:.1f} s")
    assert mb < 1024 and secs < 30
    assert err.count("\n") == 1 and err.startswith("qkv: warning:") and "512 tokens" in err   # truncated
    svg = out.read_text(encoding="utf-8")
    assert svg.count("head ") >= 12
    assert "all-MiniLM-L6-v2: layer 2" in svg and "nreimers" not in svg
