"""The tests of tests/unit/test_cli_model_option.py that need the llama extra (gguf, jinja2) or SmolLM2."""
import json
import re

import numpy as np
import pytest

pytest.importorskip("click")

from test_cli_model_option import run_cli  # noqa: E402,F401  (its helpers, shared)


def _embedded(path):
    text = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text, re.S).group(1))


@pytest.mark.model
def test_heatmap_and_view_of_smollm2_are_smollm2s(tmp_path, capsys):
    """--model smollm2 --text: the decoder's attention (causal: nothing above the diagonal), named SmolLM2."""
    pytest.importorskip("gguf")
    from qkv.models import load_llama
    text = "The cat sat."
    try:
        model = load_llama()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"no SmolLM2: {exc}")
    rc, out, err = run_cli(capsys, "heatmap", "--model", "smollm2", "--text", text, "--layer", "2",
                           "-o", tmp_path / "h.svg")
    assert rc == 0, err
    svg = (tmp_path / "h.svg").read_text(encoding="utf-8")
    assert "SmolLM2-135M-Instruct: layer 2" in svg and svg.count("head ") >= 9
    rc, out, err = run_cli(capsys, "view", "--no-why", "--model", "SmolLM2", "--text", text, "-o",
                           tmp_path / "v.html")
    assert rc == 0, err
    view = _embedded(tmp_path / "v.html")["model"]
    assert view["decoder"] is True and view["layers"] == 30 and view["heads"] == 9
    assert view["tokens"] == [str(s) for s in model.token_texts(model.encode(text))]
    w = np.asarray(view["attentions"][2][0])
    assert np.allclose(np.triu(w, 1), 0)
