"""Hostile worked-example files (issue 26): the document a file builds is bounded (aliases counted by what
they expand to)."""
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("yaml")
pytest.importorskip("click")

from qkv.cli import main  # noqa: E402
from qkv.explain import examples as ex  # noqa: E402
from qkv.explain._bound import MAX_NODES, MAX_NUMBERS  # noqa: E402

DATA = Path(__file__).parent / "data" / "check"
QKV = Path(sys.executable).with_name("qkv")


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def bomb(leaf: str, levels: int = 9, key: str = "X") -> str:
    """``&a LEAF, &b [*a ×10], &c [*b ×10], …``: a few hundred bytes that expand 10^levels-fold."""
    names = "abcdefghijklmnop"
    parts = [f"&a {leaf}"] + [f"&{b} [" + ",".join([f"*{a}"] * 10) + "]" for a, b in zip(names, names[1:levels])]
    return f"{key}: [" + ", ".join(parts) + "]\n"


BOMBS = {
    "numbers": (bomb("[1,1,1,1,1,1,1,1,1,1]"), f"expected at most {MAX_NUMBERS} numbers in a worked example, found"),
    "text": (bomb("[x,x,x,x,x,x,x,x,x,x]"), f"expected at most {MAX_NODES} values"),
    "empty lists": (bomb("[[],[],[],[],[],[],[],[],[],[]]"), f"expected at most {MAX_NODES} values"),
    "mappings": (bomb("{a: 1, b: 2, c: 3}"), f"expected at most {MAX_NUMBERS} numbers in a worked example, found"),
    "rows": ("r: &r [" + ",".join(["1"] * 1000) + "]\nX: [" + ",".join(["*r"] * 100_000) + "]\n",
             f"expected at most {MAX_NUMBERS} numbers in a worked example, found"),
    "claims": ("X: [[1]]\nW_Q: [[1]]\nW_K: [[1]]\nW_V: [[1]]\nclaims:\n  Q: "
               + bomb("[1,1,1,1,1,1,1,1,1,1]").split(": ", 1)[1], f"expected at most {MAX_NUMBERS} numbers in a worked example, found"),
}


@pytest.mark.parametrize("kind", list(BOMBS))
def test_an_alias_bomb_is_refused_at_once_naming_the_key_and_the_limit(tmp_path, kind):
    text, expected = BOMBS[kind]
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert len(text) < 500_000
    t = time.perf_counter()
    with pytest.raises(ex.WorkedExampleError) as e:
        ex.load_file(path)
    assert time.perf_counter() - t < 5                    # it hung (10⁹ nodes walked) before
    msg = str(e.value)
    assert expected in msg and msg.startswith("bomb.yaml: ") and "\n" not in msg, msg
    key = "claims" if kind == "claims" else ("r" if kind == "rows" else "X")
    assert msg.startswith(f"bomb.yaml: {key}: ") or kind == "rows", msg


@pytest.mark.parametrize("command", ["check", "explain", "view"])
def test_the_cli_refuses_an_alias_bomb_with_exit_2_and_one_line(tmp_path, capsys, command):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMBS["numbers"][0] + "W_Q: [[1]]\nW_K: [[1]]\nW_V: [[1]]\n")
    args = [command, path] + (["-o", tmp_path / "page.html"] if command == "view" else [])
    t = time.perf_counter()
    rc, out, err = run_cli(capsys, *args)
    assert time.perf_counter() - t < 10
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"at most {MAX_NUMBERS} numbers in a worked example, found 1111111110 (" in err
    assert not (tmp_path / "page.html").exists()


def test_a_list_that_contains_itself_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("X: &a [[1, 2], *a]\nW_Q: [[1]]\n")
    with pytest.raises(ex.WorkedExampleError, match=r"loop.yaml: X: a list or mapping that contains itself"):
        ex.load_file(path)


def test_too_many_numbers_without_aliases_are_refused_too(tmp_path):
    path = tmp_path / "many.json"
    row = [1] * 1000                                                  # 8 MB: under the 16 MiB a file may have
    path.write_text(json.dumps({"X": [row] * 2100, "claims": {"Q": [row] * 2100}}, separators=(",", ":")))
    with pytest.raises(ex.WorkedExampleError, match=f"many.json: claims: expected at most {MAX_NUMBERS} numbers in a worked example, found 4200000"):
        ex.load_file(path)


def test_shared_rows_within_the_limit_still_load(tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("X: [&r [1, 2], *r, *r]\nW_Q: &w [[1, 0], [0, 1]]\nW_K: *w\nW_V: *w\n")
    w = ex.load_file(path)
    assert w.X.tolist() == [[1, 2], [1, 2], [1, 2]] and w.W_K.tolist() == [[1, 0], [0, 1]]
