"""qkv check / qkv.explain.check: the matching rule, the seeds' true verdicts, planted slips, unusable files.

The verdicts asserted here were worked out by hand (see the comments): a root mistake is ``wrong``, what
follows from it ``carried``, what does not depend on it ``correct``.
"""
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.cli import main
from qkv.explain import check
from qkv.explain import examples as ex
from qkv.explain import _reading
from qkv.explain.checker import matches
from qkv.explain.examples import Number

DATA = Path(__file__).parents[1] / "data" / "check"
ROOT = Path(__file__).resolve().parents[2]
QKV = ROOT / ".venv" / "bin" / "qkv"

SEED003_INPUTS = """\
tokens: [我, 爱, 吃]
X: [[1.2, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7], [-0.3, 0.9, 1.1, 0.4]]
W_Q: [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]]
W_K: [[0.2, 0.3, 0.4], [0.5, 0.6, 0.7], [0.8, 0.9, 1.0], [1.1, 1.2, 1.3]]
W_V: [[0.3, 0.4, 0.5], [0.6, 0.7, 0.8], [0.9, 1.0, 1.1], [1.2, 1.3, 1.4]]
"""


def statuses(report):
    return {(c.name, c.row, c.col): c.status for c in report.claims}


def run_cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------------------------- the rule
def test_matching_rule_from_the_issue():
    assert matches(Number(0.39, "0.39"), 0.3912)             # half a unit of 0.39 is 0.005
    assert not matches(Number(1, "1"), 0.0)                  # 1 does not match 0
    assert matches(Number(0.5, "0.50"), 0.504) and not matches(Number(0.5, "0.50"), 0.506)
    assert matches(Number(0.5, "0.5"), 0.54)                 # one decimal: ±0.05
    assert matches(Number(1000, "1000"), 1000.9)             # 0.1 % of |value| = 1.0009 > 0.5
    assert not matches(Number(0.001, "0.001"), 0.0016)
    assert matches(Number(0.0015, "1.5e-3"), 0.00154) and not matches(Number(0.0015, "1.5e-3"), 0.00156)
    assert matches(Number(0.5, "0.5"), 0.55)                 # exactly half a unit away still matches
    assert matches(0.3, 0.7, tolerance=0.4) and not matches(Number(0.3, "0.3"), 0.71, tolerance=0.4)
    assert not matches(Number(1.0, "1"), float("nan"))


def test_numbers_keep_their_text_yaml_and_json(tmp_path):
    (tmp_path / "a.yaml").write_text("scores: [[0.50, 1e-3, 2]]\nd_k: 4\nclaims: {scaled: [[0.250, 5.0e-4, 1]]}\n")
    w = ex.load_file(tmp_path / "a.yaml")
    assert [c.text for c in w.claims["scaled"][0]] == ["0.250", "5.0e-4", "1"]
    np.testing.assert_array_equal(w.scores, [[0.5, 0.001, 2.0]])
    (tmp_path / "a.json").write_text('{"scores": [[0.50, 1E-3, 2]], "d_k": 4, "claims": {"scaled": [[0.250, 5.0e-4, 1]]}}')
    w = ex.load_file(tmp_path / "a.json")
    assert [c.text for c in w.claims["scaled"][0]] == ["0.250", "5.0e-4", "1"]
    assert check(w).ok


# ----------------------------------------------------------------------------------------------- seeds
def test_seed003_verdicts():
    r = check(ex.load_example("seed003"))
    s = statuses(r)
    for name in ("Q", "K", "V"):
        for j in range(3):
            assert s[(name, 0, j)] == "correct"                 # the 我 row is right
            assert s[(name, 1, j)] == "wrong"                   # 爱_Q = [0.01, 0.14, 0.27], not [0.05, 0.23, 0.41]
            assert s[(name, 2, j)] == "wrong"                   # 吃_Q = [1.50, 1.71, 1.92], not [0.89, 1.07, 1.25]
    for name in ("scores", "scaled", "weights", "output"):     # steps 6-8 follow from the wrong vectors
        for j in range(3):
            assert s[(name, 2, j)] == "carried", (name, j)
    assert r.summary == {"correct": 9, "carried": 12, "wrong": 18} and not r.ok and r.exit_code == 1
    c = {(c.name, c.row, c.col): c for c in r.claims}
    assert abs(c[("weights", 2, 2)].expected - 0.962987) < 5e-7      # the true weight
    assert abs(c[("weights", 2, 2)].recomputed - 0.6225) < 5e-5      # softmax of its own [1.427, 0.797, 2.354]
    assert abs(c[("scores", 2, 0)].recomputed - 2.4723) < 1e-12      # 0.89×0.57 + 1.07×0.75 + 1.25×0.93
    assert c[("Q", 1, 0)].label == "爱" and c[("K", 2, 1)].label == "吃"


def test_seed000_verdicts():
    r = check(ex.load_example("seed000"))
    s = statuses(r)
    assert s[("scores", 0, 0)] == "wrong"                    # [1,0,1,0]·[0,1,0,1] = 0, the seed says 1
    assert all(s[("scores", i, j)] == "correct" for i in range(3) for j in range(3) if (i, j) != (0, 0))
    assert s[("scaled", 0, 0)] == "carried"                  # 1/2 = 0.5 follows from the wrong score
    assert all(s[("scaled", i, j)] == "correct" for i in range(3) for j in range(3) if (i, j) != (0, 0))
    # softmax of its own [0.5, 1, 2] is [0.140, 0.231, 0.629], not [0.18, 0.24, 0.58]: new mistakes
    assert s[("weights", 0, 0)] == "wrong" and s[("weights", 0, 2)] == "wrong"
    assert s[("weights", 0, 1)] == "correct"                 # 0.24 vs the true 0.2447: within ±0.005
    assert all(s[("weights", i, j)] == "wrong" for i in (1, 2) for j in range(3))
    c = {(c.name, c.row, c.col): c for c in r.claims}
    assert abs(c[("weights", 0, 0)].recomputed - 0.1402) < 5e-5 and abs(c[("weights", 0, 0)].expected - 0.0900) < 5e-5
    assert r.summary == {"correct": 17, "carried": 1, "wrong": 9}


def test_seed002_is_correct(capsys):
    r = check(ex.load_example("seed002"))
    assert r.ok and r.summary == {"correct": 7, "carried": 0, "wrong": 0}
    rc, out, _ = run_cli(capsys, "check", "--example", "seed002", "--format", "json")
    assert rc == 0
    d = json.loads(out)
    assert d["ok"] is True and all(c["label"] is None for c in d["claims"])   # the file gives no tokens
    out_claim = [c for c in d["claims"] if c["name"] == "output"][0]
    assert out_claim["claimed"] == 5.75 and abs(out_claim["expected"] - 5.7521) < 5e-5


def test_json_report_format(capsys):
    rc, out, err = run_cli(capsys, "check", "--example", "seed003", "--format", "json")
    assert rc == 1 and err == ""
    d = json.loads(out)
    assert set(d) == {"ok", "claims", "summary"} and d["ok"] is False
    assert d["summary"] == {"correct": 9, "carried": 12, "wrong": 18}
    for c in d["claims"]:
        assert set(c) == {"name", "row", "col", "label", "claimed", "expected", "recomputed", "status"}
        assert c["status"] in ("correct", "carried", "wrong")
    first = d["claims"][0]
    assert first == {"name": "Q", "row": 0, "col": 0, "label": "我", "claimed": 0.39,
                     "expected": pytest.approx(0.39, abs=1e-12), "recomputed": pytest.approx(0.39, abs=1e-12),
                     "status": "correct"}


def test_text_report_leads_with_the_roots(capsys):
    rc, out, _ = run_cli(capsys, "check", "--example", "seed003")
    assert rc == 1
    assert out.index("Root mistakes") < out.index("Carried into") < out.index("Correct:")
    assert "Q[爱]: claimed [0.05, 0.23, 0.41]  true [0.01, 0.14, 0.27]" in out
    assert "weights[吃]: claimed [0.246, 0.131, 0.623]  true [0.0299, 0.0071, 0.963]" in out
    rc, out, _ = run_cli(capsys, "check", "--example", "seed000", "--lang", "zh")
    assert rc == 1 and "根源错误" in out and "继承" in out and "scores[token1, 0]: 声称 [1]  真实值 [0]" in out
    assert out.index("根源错误") < out.index("被继承的错误")


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.mark.parametrize("name", ["correct.yaml", "correct.json", "causal_cross.yaml", "variants.yaml"])
def test_correct_files_exit_0(capsys, name):
    rc, out, err = run_cli(capsys, "check", DATA / name)
    assert rc == 0 and err == "" and "Every claimed number is right." in out
    r = check(ex.load_file(DATA / name))
    assert r.ok and r.summary["carried"] == r.summary["wrong"] == 0 and r.summary["correct"] > 0


def test_planted_slip_in_q():
    r = check(DATA / "planted_q.yaml")                       # a path works too
    s = statuses(r)
    assert s.pop(("Q", 1, 0)) == "wrong"                     # 0.05 written for 0.01
    for key, v in s.items():
        name, row, _ = key
        if row == 1 and name != "Q":
            assert v == "carried", key                       # 爱's scores, scaled, weights, output
        else:
            assert v == "correct", key                       # 我's numbers and the rest of 爱_Q
    assert r.summary == {"correct": 11, "carried": 12, "wrong": 1}


def test_planted_slip_in_scaled(capsys):
    rc, out, _ = run_cli(capsys, "check", DATA / "planted_scaled.json", "--format", "json")
    assert rc == 1
    s = {(c["name"], c["col"]): c["status"] for c in json.loads(out)["claims"]}
    assert s[("scaled", 2)] == "wrong"                        # 5.3776 for 9.9378/√3 = 5.7376
    assert s[("scaled", 0)] == s[("scaled", 1)] == "correct"
    assert all(s[("scores", j)] == "correct" for j in range(3))
    assert all(s[(n, j)] == "carried" for n in ("weights", "output") for j in range(3))


@settings(max_examples=30)
@given(seed=st.integers(0, 100_000), L=st.integers(1, 4), D=st.integers(1, 4), E=st.integers(1, 3),
       i=st.integers(0, 3), j=st.integers(0, 2), delta=st.sampled_from([0.5, -0.7, 1.3]), causal=st.booleans())
def test_a_planted_slip_is_the_only_root(seed, L, D, E, i, j, delta, causal):
    """One Q element off by delta; every later claim computed by hand (NumPy here, not qkv) from the earlier
    claims as written to 6 decimals: exactly one `wrong`, the rest `correct` or `carried`."""
    i, j = i % L, j % E
    rng = np.random.default_rng(seed)
    X = np.round(rng.uniform(-2, 2, (L, D)), 1)
    WQ, WK, WV = (np.round(rng.uniform(-1, 1, (D, E)), 1) for _ in range(3))
    Q, K, V = X @ WQ, X @ WK, X @ WV
    r6 = lambda a: np.round(a, 6)                                     # noqa: E731
    Qs = Q.copy()
    Qs[i, j] += delta
    Qs = r6(Qs)
    s = r6(Qs @ K.T)
    sc = r6(s / math.sqrt(E))
    masked = np.where(np.tril(np.ones((L, L), bool)), sc, -np.inf) if causal else sc
    e = np.exp(masked - masked.max(-1, keepdims=True))
    w = r6(e / e.sum(-1, keepdims=True))
    o = r6(w @ V)

    def jm(a):
        return "[" + ", ".join("[" + ", ".join(f"{v:.6f}" for v in row) + "]" for row in a) + "]"

    claims = {"Q": jm(Qs), "scores": jm(s), "scaled": jm(sc), "weights": jm(w), "output": jm(o)}
    text = ('{"X": %s, "W_Q": %s, "W_K": %s, "W_V": %s, %s "claims": {%s}}'
            % (json.dumps(X.tolist()), json.dumps(WQ.tolist()), json.dumps(WK.tolist()), json.dumps(WV.tolist()),
               '"mask": "causal",' if causal else "", ", ".join(f'"{k}": {v}' for k, v in claims.items())))
    r = check(ex.from_dict(_reading._parse_json(text, "t.json")))
    st_ = statuses(r)
    assert [k for k, v in st_.items() if v == "wrong"] == [("Q", i, j)]
    assert all(st_[("scores", i, c)] == "carried" for c in range(L) if abs(delta * K[c, j]) > 0.01)
    assert all(v == "correct" for (name, row, _), v in st_.items() if row != i and name in ("scores", "scaled"))


# ----------------------------------------------------------------------------------------------- tolerance, nulls
def test_tolerance_and_null_entries(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("Q: [[1, 0, 1, 0]]\nK: [[0, 1, 0, 1], [1, 1, 1, 1]]\ntolerance: 0.05\n"
                 "claims: {weights: [[0.3, null]], scores: {0: [0.04, 2]}}\n")
    r = check(ex.load_file(f))
    # scores [0, 2]; weights softmax([0, 1]) = [0.2689, 0.7311]: 0.3 is within 0.05; 0.04 within 0.05 of 0
    assert r.ok and len(r.claims) == 3
    f.write_text(f.read_text().replace("0.05", "0.01"))
    s = statuses(check(ex.load_file(f)))
    assert s[("scores", 0, 0)] == "wrong" and s[("weights", 0, 0)] == "wrong"


def test_no_claims_is_ok(capsys):
    rc, out, _ = run_cli(capsys, "check", "--example", "causal")
    assert rc == 0 and "claims no numbers" in out


# ----------------------------------------------------------------------------------------------- unusable files
BAD = [
    ("malformed.yaml", "X: [[1, 2], [3\n", "malformed YAML at line"),
    ("malformed.json", '{"X": [[1, 2]', "malformed JSON at line 1"),
    ("tab.yaml", "X:\n\t- [1]\n", "malformed YAML"),
    ("ragged.yaml", SEED003_INPUTS.replace("[0.5, 1.3, 0.2, -0.7]", "[0.5, 1.3, 0.2]"), "X row 1: expected 4 numbers"),
    ("nonnumeric.yaml", SEED003_INPUTS.replace("-0.7", "abc"), "X[1][3]: expected a number, found 'abc'"),
    ("boolean.yaml", SEED003_INPUTS.replace("-0.7", "true"), "X[1][3]: expected a number, found true"),
    ("nested.yaml", SEED003_INPUTS.replace("-0.7", "[1]"), "X[1][3]: expected a number"),
    ("dims.yaml", SEED003_INPUTS.replace("[1.0, 1.1, 1.2]]", "]").replace("[0.7, 0.8, 0.9], ]", "[0.7, 0.8, 0.9]]"),
     "W_Q: expected 4 rows (the width of X), found 3"),
    ("dims_wk.yaml", SEED003_INPUTS.replace("W_K: [[0.2, 0.3, 0.4], [0.5, 0.6, 0.7], [0.8, 0.9, 1.0], [1.1, 1.2, 1.3]]",
                                            "W_K: [[0.2, 0.3], [0.5, 0.6], [0.8, 0.9], [1.1, 1.2]]"),
     "W_K: expected 3 columns"),
    ("claimwidth.yaml", SEED003_INPUTS + "claims: {Q: {爱: [0.05, 0.23]}}\n", "claims.Q[爱]: expected 3 numbers, found 2"),
    ("claimrows.yaml", SEED003_INPUTS + "claims: {weights: [[1, 0, 0]]}\n", "claims.weights: expected 3 rows"),
    ("unknownclaim.yaml", SEED003_INPUTS + "claims: {attention: [[1]]}\n", "unknown name 'attention'"),
    ("label.yaml", SEED003_INPUTS + "claims: {Q: {猫: [1, 2, 3]}}\n", "row '猫': no such label"),
    ("index.yaml", SEED003_INPUTS + "claims: {Q: {7: [1, 2, 3]}}\n", "row 7: expected a row index 0..2"),
    ("nan.yaml", SEED003_INPUTS.replace("-0.7", ".nan"), "X[1][3]: expected a finite number, found .nan"),
    ("inf.yaml", SEED003_INPUTS.replace("-0.7", "-.inf"), "expected a finite number, found -.inf"),
    ("nanclaim.yaml", SEED003_INPUTS + "claims: {Q: {0: [.NaN, 1, 1]}}\n", "claims.Q[我][0]: expected a finite number"),
    ("nan.json", '{"scores": [[NaN, 1]], "d_k": 1}', "expected finite numbers, found NaN"),
    ("inf.json", '{"scores": [[Infinity, 1]], "d_k": 1}', "found Infinity"),
    ("empty.yaml", "", "empty file"),
    ("comments.yaml", "# nothing here\n\n   \n", "empty file"),
    ("empty.json", "  \n", "empty file"),
    ("binary.yaml", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary file"),
    ("latin1.yaml", "title: caf\xe9\n".encode("latin-1"), "not UTF-8 text"),
    ("tag.yaml", "X: !!python/object/apply:os.system ['echo pwned > PWNED']\n", "YAML tag !!python/object/apply:os.system is not allowed"),
    ("tag2.yaml", "!!python/object:collections.OrderedDict {}\n", "is not allowed"),
    ("tag3.yaml", "X: !!binary aGVsbG8=\n", "expected a matrix"),
    ("list.yaml", "- 1\n- 2\n", "expected a mapping of keys"),
    ("scalar.json", "3", "expected a mapping of keys"),
    ("nostart.yaml", "tokens: [a]\n", "no starting point"),
    ("twostarts.yaml", SEED003_INPUTS + "Q: [[1]]\n", "expected one starting point, found X and Q/K"),
    ("nowv.yaml", SEED003_INPUTS.replace("W_V:", "W_X:"), "unknown key 'W_X'"),
    ("nodk.yaml", "scores: [[1, 2]]\n", "d_k: missing"),
    ("noV.yaml", "scores: [[1, 2]]\nd_k: 2\nclaims: {output: [[1]]}\n", "does not compute output"),
    ("tokens.yaml", SEED003_INPUTS.replace("[我, 爱, 吃]", "[我, 爱]"), "tokens: expected 3 labels"),
    ("mask.yaml", SEED003_INPUTS + "mask: [[true, false], [true, true]]\n", "mask row 0: expected 3 entries"),
    ("maskval.yaml", SEED003_INPUTS + "mask: [[1, 0, 2], [1, 1, 1], [1, 1, 1]]\n", "mask[0][2]: expected true or false"),
    ("maskword.yaml", SEED003_INPUTS + "mask: diagonal\n", "mask: expected 'causal'"),
    ("heads.yaml", SEED003_INPUTS + "heads: 2\n", "heads: 2 heads need a projection width divisible by 2"),
    ("wo.yaml", SEED003_INPUTS + "heads: 3\nW_O: [[1, 0], [0, 1]]\n", "W_O: expected 3 rows"),
    ("dup.yaml", SEED003_INPUTS.replace("[我, 爱, 吃]", "[我, 我, 吃]") + "claims: {Q: {我: [1, 2, 3]}}\n",
     "the label appears 2 times"),
    ("dk.yaml", "scores: [[1, 2]]\nd_k: -4\n", "d_k: expected a positive number"),
    ("emptymatrix.yaml", "Q: []\nK: [[1]]\n", "Q: expected a matrix with at least one row"),
    ("nullx.yaml", "tokens: [a]\nX:\nW_Q: [[1]]\n", "X: expected a matrix (a list of rows), found nothing"),
    ("dupkey.yaml", SEED003_INPUTS + "W_Q: [[1]]\n", "duplicate key 'W_Q' (line 3 and line 6)"),
    ("dupkey.json", '{"scores": [[1]], "d_k": 1, "d_k": 2}', "duplicate key 'd_k'"),
    ("perhead.yaml", SEED003_INPUTS.replace("[[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]]",
                                            "[[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]")
     .replace("W_K: [[0.2, 0.3, 0.4], [0.5, 0.6, 0.7], [0.8, 0.9, 1.0], [1.1, 1.2, 1.3]]", "W_K: [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]")
     .replace("W_V: [[0.3, 0.4, 0.5], [0.6, 0.7, 0.8], [0.9, 1.0, 1.1], [1.2, 1.3, 1.4]]", "W_V: [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]")
     + "heads: 2\nclaims: {weights: [[1, 0, 0]]}\n", "per-head weights claims are not supported"),
    ("huge.yaml", "r: &r [" + ", ".join(["1"] * 3000) + "]\n", "unknown key 'r'"),
    ("hugeX.yaml", "X: &x [" + ", ".join(["&r [" + ", ".join(["1"] * 2500) + "]"] + ["*r"] * 1999) + "]\n",
     "X: expected at most 4000000 numbers"),
]


@pytest.mark.parametrize("fname, content, msg", BAD, ids=[b[0] for b in BAD])
def test_unusable_file_one_line_exit_2(tmp_path, capsys, fname, content, msg):
    f = tmp_path / fname
    f.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    with pytest.raises(ex.WorkedExampleError):
        ex.load_file(f)
    rc, out, err = run_cli(capsys, "check", f)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("qkv: error: ") and "Traceback" not in err
    assert msg in err, err
    assert fname in err                                     # says which file
    rc, _, err2 = run_cli(capsys, "explain", f)             # explain refuses it the same way
    assert rc == 2 and err2 == err
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def test_missing_and_folder_paths(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "check", tmp_path / "none.yaml")
    assert rc == 2 and "no such file" in err and err.count("\n") == 1
    rc, _, err = run_cli(capsys, "check", tmp_path)
    assert rc == 2 and "folder" in err
    rc, _, err = run_cli(capsys, "check")
    assert rc == 2 and "expected a FILE" in err


@pytest.mark.skipif(not QKV.exists(), reason="the console script is not installed in .venv")
def test_console_script_end_to_end(tmp_path):
    """The installed `qkv` entry point: exit codes 0/1/2, one line on stderr, nothing executed from a file."""
    bad = tmp_path / "evil.yaml"
    marker = tmp_path / "PWNED"
    bad.write_text(f"X: !!python/object/apply:os.system ['touch {marker}']\n")
    binf = tmp_path / "b.yaml"
    binf.write_bytes(bytes(range(256)))
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    for args, code in ((["check", str(DATA / "correct.yaml")], 0), (["check", "--example", "seed003"], 1),
                       (["check", str(bad)], 2), (["check", str(binf)], 2), (["explain", str(bad)], 2)):
        p = subprocess.run([str(QKV), *args], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == code, (args, p.stderr)
        if code == 2:
            assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and p.stdout == ""
    assert not marker.exists()
    p = subprocess.run([str(QKV), "explain"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "\x1b[" not in p.stdout and "= 0.39" in p.stdout      # piped: plain text
    p = subprocess.run([str(QKV), "check", "--example", "seed000", "--format", "json"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 1 and json.loads(p.stdout)["summary"] == {"correct": 17, "carried": 1, "wrong": 9}


def test_worked_built_in_python():
    """A Worked made in Python (plain floats, whole-matrix claims) is checked the same way."""
    w = ex.Worked(Q=np.array([[1.0, 0, 1, 0]]), K=np.array([[0.0, 1, 0, 1], [1, 1, 1, 1]]),
                  claims={"scores": [[1, 2]], "weights": {0: [0.27, 0.73]}})
    r = check(w)
    # scores [0, 2]: the claimed 1 (written 1.0 by repr: ±0.05) is wrong; softmax([0, 1]) = [0.2689, 0.7311]
    assert [c.status for c in r.claims] == ["wrong", "correct", "correct", "correct"]
    assert all(c.label is None for c in r.claims)
    with pytest.raises(ValueError, match="does not compute output"):
        check(ex.Worked(Q=np.eye(2), K=np.eye(2), claims={"output": [[1, 2]]}))
    with pytest.raises(TypeError, match="worked"):
        check(42)
