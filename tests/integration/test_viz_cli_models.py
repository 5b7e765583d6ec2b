"""The tests of tests/unit/test_viz_cli.py that need a model package (MiniLM, SmolLM2) or its readers."""

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("matplotlib")

from test_viz_cli import SIGNATURES, assert_one_line_error, embedded, run  # noqa: E402,F401  (its helpers, shared)


@pytest.mark.model
def test_model_heatmaps_and_page(tmp_path, capsys):
    models = pytest.importorskip("qkv.models")
    try:
        models.load_bert()
    except ImportError as exc:                                      # the model package is not installed
        pytest.skip(f"no model: {exc}")
    code, _, err = run(capsys, "heatmap", "--text", "The cat sat.", "--layer", "1", "--head", "2",
                       "-o", str(tmp_path / "h.png"))
    assert code == 0, err
    assert (tmp_path / "h.png").read_bytes().startswith(SIGNATURES[".png"])
    code, _, err = run(capsys, "heatmap", "--text", "The cat sat.", "--layer", "1", "--all-heads",
                       "-o", str(tmp_path / "g.svg"))
    assert code == 0, err
    assert (tmp_path / "g.svg").read_text(encoding="utf-8").count("head ") >= 12
    code, _, err = run(capsys, "heatmap", "--text", "The cat sat.", "--layer", "99", "-o", str(tmp_path / "x.png"))
    assert_one_line_error(code, err, r"--layer: expected 0 … 5, got 99")
    code, _, err = run(capsys, "view", "--text", "The cat sat.", "-o", str(tmp_path / "m.html"))
    assert code == 0, err
    model = embedded(tmp_path / "m.html")["model"]
    assert model["tokens"][0] == "[CLS]" and model["tokens"][-1] == "[SEP]"
    assert model["layers"] == 6 and model["heads"] == 12
    from qkv.models import load_bert
    out = load_bert().run(["The cat sat."])
    np.testing.assert_allclose(model["attentions"][4][7], out.attentions[4][0, 7], atol=1e-6)
