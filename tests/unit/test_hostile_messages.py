"""Messages that misled (issue 26): each now says what is wrong in the user's terms, names the file, key or
argument, and is short (long values cut with an ellipsis)."""
import numpy as np
import pytest

import qkv

pytest.importorskip("yaml")
pytest.importorskip("click")

from qkv.cli import main  # noqa: E402
from qkv.explain import examples as ex  # noqa: E402

BIG_INT = "9" * 100_000
HUGE_FLOAT = "1e" + "9" * 1_000_000


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name, text, key", [
    ("int.yaml", f"X: [[1, {BIG_INT}]]\nW_Q: [[1]]\n", r"X\[0\]\[1\]"),
    ("rows.yaml", f"X:\n  - [1, 2]\n  - [3, -{BIG_INT}]\nW_Q: [[1]]\n", r"X\[1\]\[1\]"),
    ("int.json", '{"X": [[1, %s]], "W_Q": [[1]]}' % BIG_INT, r"X\[0\]\[1\]"),
    ("dk.yaml", f"scores: [[1, 2]]\nd_k: {BIG_INT}\n", "d_k"),
    ("float.yaml", f"X: [[1, {HUGE_FLOAT}]]\nW_Q: [[1]]\n", r"X\[0\]\[1\]"),
])
def test_a_number_too_long_names_its_key_in_a_short_line(tmp_path, capsys, name, text, key):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ex.WorkedExampleError, match=rf"^{name}: {key}: expected a finite number, found \S+…\(\d+ "
                                                    r"characters\)$") as e:
        ex.load_file(path)
    assert len(str(e.value)) < 120 and "set_int_max_str_digits" not in str(e.value)
    rc, out, err = run_cli(capsys, "check", path)
    assert rc == 2 and err.count("\n") == 1 and len(err) < 140


def test_an_outsized_scale_is_named_with_the_bound_it_crosses():
    q = np.ones((1, 1, 4, 8))
    with pytest.raises(ValueError, match=r"^scale: the scores q·k·scale with scale = 1e\+300 reach about 8e\+300 "
                                         r".*over the 1e\+300 that float64 \(up to 1\.8e\+308\) leaves"):
        qkv.scaled_dot_product_attention(q, q, q, scale=1e300)
    with pytest.raises(ValueError, match=r"^query, key: the scores"):
        qkv.scaled_dot_product_attention(q * 1e160, q * 1e160, q)


# ---------------------------------------------------------------------------------------------- models
def test_a_prompt_that_is_not_utf8_says_so(capsys):
    from qkv.models._common import check_utf8, texts_arg

    bad = b"\xff\xfehello".decode("utf-8", "surrogateescape")      # how Python passes such an argument on
    with pytest.raises(ValueError, match=r"^prompt: not UTF-8 text \(byte 0xff at character 0\)"):
        check_utf8(bad, "prompt")
    with pytest.raises(ValueError, match=r"^texts\[1\]: not UTF-8 text \(byte 0xfe at character 3\)"):
        texts_arg(["ok", "abc" + bad[1:]])
    rc, out, err = run_cli(capsys, "model", bad)
    assert rc == 2 and err == "qkv: error: TEXT: not UTF-8 text (byte 0xff at character 0); expected text in " \
                              "UTF-8 (was it written in another encoding?)\n"
