"""The tests of tests/unit/test_viz_page.py that need a model package (MiniLM, SmolLM2) or its readers."""

import re

import numpy as np
import pytest

from qkv import viz


# ------------------------------------------------------------------------------------------ the page at any size
from qkv.viz import page as vpage   # noqa: E402


@pytest.mark.model
def test_model_data_is_exact_for_minilm_and_the_decoder():
    models = pytest.importorskip("qkv.models")
    try:
        bert = models.load_bert()
        llama = models.load_llama()
    except ImportError as exc:
        pytest.skip(f"no model: {exc}")
    text = "The bank by the river has a tall tree; it is very old."
    for model in (bert, llama):
        d = viz.model_data(text, model=model)
        out = model.run([text])
        T = d["T"]
        got = vpage.decode_maps(d["maps"])
        assert len(got) == d["layers"] * d["heads"] and d["tokens"] == list(out.tokens[0][:T])
        for li, a in enumerate(out.attentions):
            for h in range(d["heads"]):
                np.testing.assert_array_equal(got[li * d["heads"] + h], vpage.quantize(np.asarray(a)[0, h, :T, :T]))
        np.testing.assert_allclose(d["attentions"][2][1], np.asarray(out.attentions[2])[0, 1, :T, :T], atol=1e-6)
    assert viz.model_data(text, model=bert)["name"] == "all-MiniLM-L6-v2"


def test_readme_viz_section_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "viz.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- BEGIN section:viz -->(.*?)<!-- END section:viz -->", readme, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/viz.md", "exec"), {})
    assert (tmp_path / "seed003.png").read_bytes().startswith(b"\x89PNG")
    assert b"<svg" in (tmp_path / "heads.svg").read_bytes()[:1000]
    assert (tmp_path / "attention.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
