"""The tests of tests/unit/test_heads.py that need a model package (MiniLM, SmolLM2) or its readers."""
import numpy as np
import pytest

from qkv import viz


# ----------------------------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("click")
    models = pytest.importorskip("qkv.models")
    try:
        return models.load_bert()
    except ImportError as exc:
        pytest.skip(f"no model: {exc}")


SENTENCE = "银行旁边有一棵树，它很高"


@pytest.mark.model
def test_heads_summary_and_rollout_on_the_seed_sentence(minilm, capsys):
    from qkv.cli import main

    assert main(["model", SENTENCE, "--heads-summary"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "heads at a glance: all-MiniLM-L6-v2, 6 layers × 12 heads, 14 tokens (qkv.viz.head_kinds)"
    assert lines[1].split() == ["layer"] + [str(h) for h in range(12)]
    assert [ln.split()[0] for ln in lines[2:8]] == [str(l) for l in range(6)]
    res = minilm.run([SENTENCE])
    hk = viz.head_kinds(res)
    assert hk.kind[0, 2] == "previous" and hk.scores["previous"][0, 2] > 0.95   # layer 0 head 2: previous token
    assert lines[2][6 + 5 * 2:6 + 5 * 2 + 4] == "P 99"
    assert "strongest: previous token L0 H2 1.00" in out
    # the tokenizer: 它 and 树 are not in the uncased English vocabulary → [UNK] at #10 and #8
    assert res.tokens[0][8] == res.tokens[0][10] == "[UNK]"
    assert main(["model", SENTENCE, "--rollout", "--token", "#10", "--top", "3"]) == 0
    out = capsys.readouterr().out
    R = viz.rollout(res)
    top = np.argsort(-R[10], kind="stable")[:3]
    assert f"rollout: [CLS] {R[10, 0]:.3f}" in out and top[0] == 0
    assert "flow: " in out
    assert main(["model", SENTENCE, "--rollout", "--token", "高", "--lang", "zh"]) == 0
    assert "注意力 rollout" in capsys.readouterr().out
    # a token that is not there, or an index past the end: one line, exit 2, with and without --rollout
    for extra in (["--rollout"], []):
        for tok in ("zebra", "#99"):
            assert main(["model", SENTENCE, *extra, "--token", tok]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("qkv: ") and tok.lstrip("#") in err, err


@pytest.mark.model
def test_the_readme_heads_example_prints_its_numbers(minilm, capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "viz.md").read_text(encoding="utf-8")
    viz_section = re.search(r"<!-- BEGIN section:viz -->(.*?)<!-- END section:viz -->", text, re.S).group(1)
    block = next(b for b in re.findall(r"```python\n(.*?)```", viz_section, re.S) if "head_kinds" in b)
    exec(compile(block, "docs/viz.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[(0, 2, 0.99")
    assert out[1] == "0.152" and out[2] == "0.017 0.063"
    assert "layer 0 head 5, 0.152" in viz_section and "0.017 of what reaches `#10`" in viz_section
