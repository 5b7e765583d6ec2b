"""Hostile worked-example files (issue 26): the document a file builds is bounded (aliases counted by what
they expand to), and ``qkv check`` streams a large trace by query rows, so its memory follows the claims."""
import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("yaml")
pytest.importorskip("click")

from qkv.cli import main  # noqa: E402
from qkv.explain import check  # noqa: E402
from qkv.explain import _run  # noqa: E402  (the runner reads LARGE_CELLS, BLOCK_CELLS)
from qkv.explain import examples as ex  # noqa: E402
from qkv.explain._bound import MAX_NODES, MAX_NUMBERS  # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data" / "check"
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


# ----------------------------------------------------------------------------------------------- check streams
def _claims_large(monkeypatch, worked):
    """check() on ``worked`` whole, then as a large example (streamed in blocks of 2 query rows)."""
    whole = check(worked)
    monkeypatch.setattr(_run, "LARGE_CELLS", 0)
    monkeypatch.setattr(_run, "BLOCK_CELLS", 2 * worked.n_keys)
    assert ex.is_large(worked)
    streamed = check(worked)
    monkeypatch.undo()
    return whole, streamed


def _planted(w) -> dict:
    """Claims on the last row of every one-head step, the first number of the first one slipped by 1."""
    tr = ex.run(w)
    claims = {}
    for name in ex.CLAIM_NAMES:
        a = tr[name].array if name in tr else None
        if a is not None and a.ndim >= 2 and a.size == a.shape[-2] * a.shape[-1]:
            a = a.reshape(a.shape[-2:])
            claims[name] = {a.shape[0] - 1: [round(float(x), 2) for x in a[-1]]}
    first = claims[next(iter(claims))]
    first[next(iter(first))][0] += 1
    return claims


@pytest.mark.parametrize("source", ["seed003", "seed000", "seed002", "two_head", "causal", "cross", "sinks",
                                    "alibi", DATA / "planted_q.yaml", DATA / "planted_scaled.json",
                                    DATA / "variants.yaml", DATA / "causal_cross.yaml"])
def test_check_streamed_by_query_rows_gives_the_same_report(monkeypatch, source):
    w = ex.load_file(source) if isinstance(source, Path) else ex.load_example(source)
    if not w.claims:
        w = dataclasses.replace(w, claims=_planted(w))
    whole, streamed = _claims_large(monkeypatch, w)
    assert whole.claims, source
    assert len(streamed.claims) == len(whole.claims) and streamed.summary == whole.summary
    for a, b in zip(streamed.claims, whole.claims):     # a block's GEMM may round its last bit otherwise
        assert (a.name, a.row, a.col, a.label, a.text, a.status) == (b.name, b.row, b.col, b.label, b.text, b.status)
        assert a.expected == pytest.approx(b.expected, rel=1e-12) and a.recomputed == pytest.approx(b.recomputed,
                                                                                                   rel=1e-12)


def test_check_streamed_reports_a_claimed_row_out_of_range(monkeypatch):
    w = ex.load_example("seed003")
    w = dataclasses.replace(w, claims={"weights": {5: [0.1, 0.2, 0.7]}})
    monkeypatch.setattr(_run, "LARGE_CELLS", 0)
    with pytest.raises(ValueError, match=r"worked.claims\['weights'\]\[5\]: expected a row index 0..2"):
        check(w)


def test_check_of_10000_tokens_is_bounded(tmp_path):
    from test_viz_scale import _big_explain_file, peak

    src = _big_explain_file(tmp_path / "big.json")
    doc = json.loads(src.read_text())
    doc["claims"] = {"weights": {"w5000": [None] * 9999 + [0.5]}, "Q": {"w1": [0.1, 0.2, 0.3]}}
    src.write_text(json.dumps(doc))
    rc, out, err, mb, secs = peak(QKV, "check", src, "--format", "json")
    assert rc == 1, err
    print(f"qkv check, 10,000 tokens: peak RSS {mb:.0f} MB, {secs:.1f} s")
    assert mb < 1024 and secs < 60                                   # the whole trace took 3.5 GB
    report = json.loads(out)
    assert [c["name"] for c in report["claims"]] == ["Q"] * 3 + ["weights"]
    assert report["claims"][-1]["row"] == 5000 and report["claims"][-1]["col"] == 9999
