"""The tests of tests/unit/test_page_why_flow.py that need a model package (MiniLM, SmolLM2) or its readers."""
from __future__ import annotations

import numpy as np
import pytest

from qkv import viz
from qkv.viz import page as vpage
from test_page_why_flow import embedded  # noqa: E402,F401  (its helpers, shared)


@pytest.mark.model
def test_qkv_view_model_flow_is_minilms_and_over_the_limit_a_note(tmp_path, capsys):
    pytest.importorskip("networkx")
    from qkv.cli import main
    from qkv.models import load_bert

    out = tmp_path / "m.html"
    assert main(["view", "--no-why", "--text", "The cat sat on the mat.", "-o", str(out)]) == 0
    assert "flow" not in capsys.readouterr().err
    model = embedded(out.read_text(encoding="utf-8"))["model"]
    F = viz.attention_flow(load_bert().run(["The cat sat on the mat."]).attentions)      # (9, 9)
    np.testing.assert_array_equal(vpage.decode_maps(model["flow"])[0], vpage.quantize(np.clip(F, 0.0, 1.0)))
    assert main(["view", "--no-why", "--text", "银行旁边有一棵树，它很高", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "qkv: note: Attention flow is not shown" in err and "up to 12 tokens through 6 layers" in err
    assert "this one has 14" in err and err.count("\n") == 1
    model = embedded(out.read_text(encoding="utf-8"))["model"]
    assert model["flow"] is None and model["flow_limit"] == {"reason": "size", "limit": 12, "layers": 6}
