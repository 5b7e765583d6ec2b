"""The third hostile-input round (issue 40, item 4): numbers past every bound in worked-example files, control
characters in what reaches the terminal, a temperature too small to divide by."""
import pytest

from cli_checks import one_line, run

EXAMPLE = "title: t\nX: [[1,0],[0,1]]\nW_Q: [[1,0],[0,1]]\nW_K: [[1,0],[0,1]]\nW_V: [[1,0],[0,1]]\n"


@pytest.mark.parametrize("extra, key", [("rope:\n  positions: [100000000000000000000, 1]\n", "rope.positions"),
                                        ("rope:\n  positions: [0, 2147483648]\n", "rope.positions"),
                                        ("documents:\n  ids: [10000000000000000000000000000, 1]\n", "documents.ids")])
@pytest.mark.parametrize("command", ["explain", "check"])
def test_integers_past_every_bound_are_one_line(capsys, tmp_path, extra, key, command):
    f = tmp_path / "w.yaml"
    f.write_text(EXAMPLE + extra)
    code, out, err = run(capsys, command, f)
    one_line(code, err, rf"{key}\[\d\]: expected an integer ≥ 0 of at most 2,147,483,647")


def test_control_characters_in_a_title_or_label_are_shown_not_obeyed(capsys, tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text('title: "A\\e]0;pwned\\a B\\e[2J"\ntokens: ["x\\e[31m", "y"]\n' + EXAMPLE.split("\n", 1)[1])
    for command in ("explain", "check"):
        code, out, err = run(capsys, command, f)
        assert code == 0, err
        assert "\x1b" not in out and "\x07" not in out
        assert "A\\x1b]0;pwned\\x07 B\\x1b[2J" in out
    code, out, err = run(capsys, "explain", f)
    assert "x\\x1b[31m" in out


@pytest.mark.parametrize("t", ["1e-320", "0.0009", "-1"])
def test_a_temperature_too_small_to_divide_by_is_refused_before_loading(capsys, t):
    code, out, err = run(capsys, "generate", "hi", "-T", t)
    one_line(code, err, r"-T/--temperature: expected 0 \(greedy\) or a number >= 0\.001")


def test_the_library_refuses_it_too():
    from qkv.models._generate import check_sampling
    with pytest.raises(ValueError, match="temperature: expected 0"):
        check_sampling(temperature=1e-320)
    assert check_sampling(temperature=0.001)[1] == 0.001 and check_sampling(temperature=0.0)[1] == 0.0


@pytest.mark.parametrize("example, given", [("alibi", "biased"), ("causal", "scaled")])
@pytest.mark.parametrize("lang, line", [("en", "masked = {} where mask is True, −∞ elsewhere"),
                                        ("zh", "masked = {}（mask 为 True 处），其余位置为 −∞")])
def test_the_mask_step_names_the_scores_its_table_holds(capsys, example, given, lang, line):
    """After ALiBi the mask is applied to the biased scores, and the step says so (it said ``scaled``), in
    either language."""
    code, out, err = run(capsys, "explain", "--example", example, "--lang", lang)
    assert code == 0, err
    assert line.format(given) in out


def test_every_built_in_title_is_translated(capsys):
    from qkv import locales
    from qkv.explain import examples as ex
    code, out, err = run(capsys, "examples", "--lang", "zh")
    assert code == 0, err
    for name in ex.builtin_names():
        zh, en = locales.t(ex.TITLE_KEYS[name], "zh"), locales.t(ex.TITLE_KEYS[name], "en")
        assert zh != en and zh in out
    code, out, err = run(capsys, "explain", "--example", "document", "--lang", "zh")
    assert out.splitlines()[0] == locales.t("explain.example_document", "zh")
    code, out, err = run(capsys, "check", "--example", "alibi", "--lang", "zh")
    assert locales.t("explain.example_alibi", "zh") in out
