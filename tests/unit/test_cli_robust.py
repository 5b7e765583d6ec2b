"""Found when tried as a new user would (issue 11), each a test: a missing extra is one line naming it (exit 2),
deep nesting is one line (exit 2), YAML loads within 5× the JSON time keeping each number's text, every
written-out line adds up at every precision, --heads' title and help, the README's causal example, JSON numbers
as the shortest text of their type, and --tokens swallowing FILE."""
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("click")
yaml = pytest.importorskip("yaml")

import qkv  # noqa: E402
from qkv.explain import examples as ex  # noqa: E402
from qkv.explain import _reading  # noqa: E402
import importlib  # noqa: E402

render = importlib.import_module("qkv.explain.render")

ROOT = Path(__file__).resolve().parents[2]
QKV = Path(sys.executable).with_name("qkv")


from cli_checks import one_line, run  # noqa: E402

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------------------------- missing extras
#: sitecustomize.py for the child: every module named in QKV_TEST_BLOCK (and its submodules) is missing.
BLOCKER = textwrap.dedent("""
    import importlib.abc, os, sys
    _BLOCK = set(filter(None, os.environ.get("QKV_TEST_BLOCK", "").split(",")))
    class _Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _BLOCK:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _Missing())
""")

OPTIONAL = "matplotlib,networkx,safetensors,tokenizers,gguf,jinja2,torch,threadpoolctl"


@pytest.fixture(scope="module")
def blocker(tmp_path_factory):
    d = tmp_path_factory.mktemp("blocker")
    (d / "sitecustomize.py").write_text(BLOCKER)
    return d


def without(blocker, block: str, *args, cwd=None):
    env = dict(os.environ, QKV_TEST_BLOCK=block, PYTHONPATH=str(blocker))
    p = subprocess.run([str(QKV), *map(str, args)], capture_output=True, text=True, env=env, timeout=180,
                       cwd=cwd)
    return p.returncode, p.stdout, p.stderr


def test_the_blocker_works(blocker):
    env = dict(os.environ, QKV_TEST_BLOCK="matplotlib", PYTHONPATH=str(blocker))
    p = subprocess.run([sys.executable, "-c", "import matplotlib"], capture_output=True, text=True, env=env)
    assert p.returncode == 1 and "ModuleNotFoundError" in p.stderr


#: (command, the extra it needs or None) — every command of the CLI, with none of the optional extras installed.
COMMANDS = [
    (["explain"], None),
    (["examples"], None),
    (["check", "--example", "seed003"], None),
    (["view", "-o", "{tmp}/v.html"], None),
    (["heatmap", "-o", "{tmp}/h.png"], "viz"),
    (["heatmap", "--text", "hi", "-o", "{tmp}/h.png"], "viz|model"),
    (["view", "--text", "hi", "-o", "{tmp}/m.html"], "model"),
    (["model", "hi"], "model"),
    (["model", "hi", "--model", "smollm2"], "llama"),
    (["generate", "hi"], "llama"),
    (["lab", "scale", "--samples", "16", "--keys", "2", "--plot", "{tmp}/s.png"], "viz"),
    (["ring", "-p", "2", "-n", "16"], "torch"),
    (["bench", "--lengths", "64", "--modes", "forward", "--impls", "tiled", "--repeats", "1", "--no-memory"], None),
]


@pytest.mark.parametrize("args, extra", COMMANDS, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_every_command_without_its_extra_is_one_line_naming_it(blocker, tmp_path, args, extra):
    from qkv.cli._app import cli

    if args[0] not in cli.commands:
        pytest.skip(f"no command {args[0]} here")
    code, out, err = without(blocker, OPTIONAL, *[a.replace("{tmp}", str(tmp_path)) for a in args], cwd=tmp_path)
    assert "Traceback" not in err, err
    if extra is None:
        assert code in (0, 1), err                                     # check: 1 = claims wrong
        return
    one_line(code, err, r"pip install .*'qkv\[(%s)\]'" % extra)
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.html"))       # nothing half-written


def test_import_errors_in_process_name_the_extra(monkeypatch, capsys, tmp_path):
    import importlib

    hm = importlib.import_module("qkv.viz.heatmap")

    def missing():
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    monkeypatch.setattr(hm, "_matplotlib", missing)
    one_line(*run(capsys, "heatmap", "-o", tmp_path / "h.png")[::2],
             r"qkv heatmap needs matplotlib \(the viz extra\): pip install 'qkv\[viz\]'")


# ----------------------------------------------------------------------------------------------- deep nesting
@pytest.mark.parametrize("command", ["check", "explain"])
def test_deeply_nested_files_are_one_line(tmp_path, capsys, command):
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"X": ' + "[" * 5000 + "]" * 5000 + "}")
    one_line(*run(capsys, command, deep_json)[::2], "nested too deeply")
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("X: " + "[" * 100_000 + "]" * 100_000 + "\n")
    one_line(*run(capsys, command, deep_yaml)[::2], r"deep\.yaml")
    block = tmp_path / "block.yaml"
    block.write_text("".join("  " * i + "a:\n" for i in range(3000)))
    one_line(*run(capsys, command, block)[::2], r"block\.yaml")


def test_deep_yaml_with_the_pure_python_loader(tmp_path, capsys, monkeypatch):
    """Without libyaml (PyYAML's pure-Python parser recurses): RecursionError becomes the same one line."""
    monkeypatch.delattr(yaml, "CSafeLoader", raising=False)
    deep = tmp_path / "deep.yaml"
    deep.write_text("X: " + "[" * 5000 + "]" * 5000 + "\n")
    one_line(*run(capsys, "check", deep)[::2], "nested too deeply")


# ----------------------------------------------------------------------------------------------- YAML speed and text
def _matrix_files(tmp_path, n=400):
    rng = np.random.default_rng(0)
    S = np.round(rng.normal(size=(n, n)), 3)
    y, j = tmp_path / "m.yaml", tmp_path / "m.json"
    y.write_text("d_k: 4\nscores:\n" + "".join("  - [" + ", ".join(repr(float(v)) for v in r) + "]\n" for r in S))
    j.write_text(json.dumps({"d_k": 4, "scores": S.tolist()}))
    return y, j, S


def test_yaml_loads_within_5x_json_and_keeps_each_numbers_text(tmp_path):
    y, j, S = _matrix_files(tmp_path)
    assert y.stat().st_size > 1_000_000

    def best(path):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            w = ex.load_file(path)
            times.append(time.perf_counter() - t)
        return min(times), w
    ty, wy = best(y)
    tj, wj = best(j)
    print(f"YAML {ty:.2f} s, JSON {tj:.2f} s ({ty / tj:.1f}×)")
    assert ty <= 5 * tj
    np.testing.assert_array_equal(wy.scores, S)
    np.testing.assert_array_equal(wy.scores, wj.scores)


def test_yaml_fast_path_reads_as_yaml_does(tmp_path):
    text = textwrap.dedent("""\
        title: "rows [1, 2] in a title stay text"
        description: |
          a block scalar line
          [1, 2] stays as written
        tokens: [我, 爱, 吃]
        X: [[1.20, 0.8, -0.5, 0.3], [0.5, 1.3, 0.2, -0.7],
            [-0.3, 0.9, 1.1, 0.4]]
        W_Q:
          - [0.1, 0.2, 0.3]
          - [0.4, 0.5, 0.6]   # a comment keeps this row on the YAML path
          - [0.7, 0.8, 0.9]
          - [1.0, 1.1, 1.2]
        W_K: [[0.2, 0.3, 0.4], [0.5, 0.6, 0.7], [0.8, 0.9, 1.0], [1.1, 1.2, 1.3]]
        W_V: [[0.3, 0.4, 0.5], [0.6, 0.7, 0.8], [0.9, 1.0, 1.1], [1.2, 1.3, 1e-3]]
        claims:
          Q: {爱: [0.01, 0.14, 0.270]}
          K: [[012, 1_000, 0x1F], [1.0e5, .5, +1], [-0, 1., 2]]
        """)
    _, Loader = _reading._yaml_loader()
    plain = yaml.load(text, Loader=Loader)                              # no fast path
    fast = _reading._parse_yaml(text, "t.yaml")
    assert fast == plain
    texts = lambda d: [getattr(x, "text", None) for row in d for x in (row if isinstance(row, list) else [row])]
    assert texts(fast["X"]) == texts(plain["X"]) and "1.20" in texts(fast["X"])
    assert [x.text for x in fast["claims"]["Q"]["爱"]] == ["0.01", "0.14", "0.270"]
    assert fast["claims"]["K"] == plain["claims"]["K"]                  # octal, 1_000, hex: read by YAML
    assert fast["description"] == "a block scalar line\n[1, 2] stays as written\n"
    assert fast["W_V"][3][2] == 0.001 and fast["W_V"][3][2].text == "1e-3"


# ----------------------------------------------------------------------------------------------- lines add up
def _relations(text):
    """Every written-out product/division line: (the expression's exact value from the shown numbers, the shown
    result, its decimals, whether it is marked ≈)."""
    out = []
    for line in text.splitlines():
        m = re.search(r"= ((?:\(?−?[\d.e−]+\)?×\(?−?[\d.e−]+\)?(?: \+ )?)+) (=|≈) (−?[\d.e−]+)\s*$", line)
        if m and "…" not in line:
            terms = [t.split("×") for t in m.group(1).split(" + ")]
            val = sum((Decimal(a.strip("()").replace("−", "-")) * Decimal(b.strip("()").replace("−", "-"))
                       for a, b in terms), Decimal(0))
            out.append((val, m.group(3), m.group(2), line))
        for d in re.finditer(r"(−?[\d.]+) / (−?[\d.]+) (=|≈) (−?[\d.e−]+)", line):
            a, b = (Decimal(x.replace("−", "-")) for x in d.group(1, 2))
            out.append((a / b, d.group(4), d.group(3), line))
    return out


@pytest.mark.parametrize("precision", [0, 1, 2, 4, 6])
@pytest.mark.parametrize("name", ["seed003", "two_head", "causal", "cross"])
def test_every_written_out_line_adds_up(capsys, precision, name):
    code, out, _ = run(capsys, "explain", "--example", name, "--precision", precision)
    assert code == 0
    rels = _relations(out)
    assert len(rels) > 10
    for exact, shown, sym, line in rels:
        value = Decimal(shown.replace("−", "-"))
        unit = Decimal(1).scaleb(min(-precision, value.as_tuple().exponent))
        if sym == "=":
            assert abs(exact - value) < unit / 2, line            # the shown result is the exact one, rounded
        else:
            assert abs(exact - value) >= unit / 2, line           # ≈ only where it does not add up
    if precision == 0 and name == "seed003":
        assert "Q[我, 1] = 1.2×0.2 + 0.8×0.5 + (−0.5)×0.8 + 0.3×1.1 = 1" in out
        assert "1×0 + 1×0 + 0×1 + 0×1 = 1" not in out


# ----------------------------------------------------------------------------------------------- --heads, README
def test_heads_title_and_help(capsys):
    code, out, _ = run(capsys, "explain", "--heads", "3")
    assert code == 0
    assert out.splitlines()[0] == "Seed 003 · 我 爱 吃 — 3 heads (--heads 3)" and "one head" not in out.splitlines()[0]
    code, out, _ = run(capsys, "explain", "--help")
    helptext = " ".join(out.split())
    assert "square W_Q" not in helptext and "whose W_Q and W_V widths it divides" in helptext


def test_the_readme_causal_example_picks_a_row_the_mask_changes(capsys):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"qkv explain --mask causal --query (\S+)", readme)
    assert m
    token = m.group(1)
    w = ex.load_example("seed003")
    row = w.tokens.index(token)
    plain = ex.run(w)["weights"].array[row]
    causal = ex.run(w, mask="causal")["weights"].array[row]
    assert not np.allclose(plain, causal)                              # masking changes this row
    code, out, _ = run(capsys, "explain", "--mask", "causal", "--query", token)
    assert code == 0 and "weights = softmax(masked)" in out and "softmax(scaled)" not in out


# ----------------------------------------------------------------------------------------------- JSON numbers
def test_json_numbers_are_the_shortest_text_of_their_type():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(3))
    t = qkv.Trace()
    qkv.scaled_dot_product_attention(q, k, v, trace=t)
    text = render.render(t, fmt="json")
    numbers = re.findall(r"-?\d+\.\d+(?:e-?\d+)?", text.split('"sections"', 1)[1])
    assert numbers
    for s in numbers:
        x = np.float32(float(s))
        assert s == str(x) or s == repr(float(str(x))), s               # the shortest float32 text
    doc = json.loads(text)
    tb = next(it for sec in doc["sections"] if sec["step"] == "weights" for it in sec["items"] if it["type"] == "table")
    np.testing.assert_array_equal(np.array(tb["values"], dtype=np.float32), t["weights"].array)
    # float64 stays float64's shortest (repr), read back bit for bit
    t64 = qkv.Trace()
    qkv.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), trace=t64)
    doc = json.loads(render.render(t64, fmt="json"))
    tb = next(it for sec in doc["sections"] if sec["step"] == "weights" for it in sec["items"] if it["type"] == "table")
    np.testing.assert_array_equal(np.array(tb["values"]), t64["weights"].array)


# ----------------------------------------------------------------------------------------------- --tokens FILE
@pytest.mark.parametrize("command", ["view", "heatmap"])
def test_tokens_swallowing_the_file_gets_a_hint(tmp_path, capsys, command):
    src = ROOT / "src" / "qkv" / "examples" / "causal.yaml"
    out = tmp_path / ("a.html" if command == "view" else "a.png")
    one_line(*run(capsys, command, "--tokens", "a", "b", "c", src, "-o", out)[::2],
             r"--tokens: its last word .*causal\.yaml.* looks like the example FILE.*put FILE before it")
    code, _, err = run(capsys, command, src, "--tokens", "a", "b", "c", "-o", out)
    assert code == 0, err


# ----------------------------------------------------------------------------------------------- qkv bench
def test_bench_refuses_lengths_that_cannot_fit_before_running(capsys):
    t = time.perf_counter()
    one_line(*run(capsys, "bench", "--lengths", "16000000")[::2],
             r"--lengths/--heads/--dim/--batch: N = 16000000, .* need about [\d,.]+ GiB .* more than the [\d,.]+ GiB "
             "available")
    assert time.perf_counter() - t < 5                                   # nothing was run


def test_bench_checks_the_plot_name_up_front(capsys, tmp_path):
    t = time.perf_counter()
    one_line(*run(capsys, "bench", "--plot", tmp_path / "x.txt")[::2],
             r"--plot: expected a file name ending in \.png, \.svg or \.pdf")
    assert time.perf_counter() - t < 5 and not list(tmp_path.iterdir())


def test_bench_without_torch_selected_does_not_mention_torch(capsys):
    code, out, err = run(capsys, "bench", "--lengths", "32", "--modes", "forward", "--impls", "tiled",
                         "--repeats", "1", "--no-memory", "--no-progress")
    assert code == 0, err
    assert "torch" not in out.splitlines()[0] + out.splitlines()[1] and "not installed" not in out
