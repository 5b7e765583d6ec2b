"""The docs cannot drift from the code: every ``qkv.…`` name the README and docs/*.md mention exists, and the
architecture page's list of layers is the import-linter contract's (pyproject.toml), layer for layer."""
import ast
import importlib
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
NAME = re.compile(r"(?<![\w.])qkv(?:\.[A-Za-z_]\w*)+")


def mentioned_names():
    """Every dotted ``qkv.…`` name of the pages, in prose and code alike, with the first page that names it."""
    names = {}
    for page in PAGES:
        for name in NAME.findall(page.read_text(encoding="utf-8")):
            names.setdefault(name, page.relative_to(ROOT).as_posix())
    return sorted(names.items())


def _top_level_names(path):
    """What a module's file binds at its top level, read without running it (a module whose import needs an
    extra that is missing here, as qkv.torch needs torch)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _is_module(name):
    try:
        return importlib.util.find_spec(name) is not None            # imports the parents, not the module
    except (ImportError, ValueError):             # a parent that is a module, not a package, or needs an extra
        return False


def resolves(name):
    """Whether ``qkv.a.b.c`` is a module, or an attribute (chain) of the longest module prefix."""
    parts = name.split(".")
    i = next(i for i in range(len(parts), 0, -1) if _is_module(".".join(parts[:i])))
    module, rest = ".".join(parts[:i]), parts[i:]
    try:
        obj = importlib.import_module(module)
    except ImportError:                                               # an extra this environment lacks
        from qkv import _public                                       # a public name's file is its home's
        origin = importlib.util.find_spec(_public.home(module) or module).origin
        return not rest or rest[0] in _top_level_names(pathlib.Path(origin))
    for attr in rest:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_the_scan_finds_names_in_prose_and_code_and_refuses_missing_ones():
    text = "`qkv.masks.causal(5, 7)` and qkv.positions.rope; not myqkv.x, nor a.qkv.y"
    assert NAME.findall(text) == ["qkv.masks.causal", "qkv.positions.rope"]
    assert resolves("qkv.masks.causal") and resolves("qkv.backends.runtime.RUNTIME")
    assert not resolves("qkv.rope") and not resolves("qkv.masks.no_such_builder")


@pytest.mark.parametrize(("name", "page"), mentioned_names())
def test_every_qkv_name_in_the_docs_exists(name, page):
    assert resolves(name), f"{page} names {name}, which qkv does not have"


def _hook():
    spec = importlib.util.spec_from_file_location("layers_hook", ROOT / "docs" / "hooks" / "layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_page_lists_the_contracts_layers():
    """The page's list is written from the contracts at build time: the hook reads every layers contract as
    tomllib does, every layer carries its comment, and the rendered page names each layer."""
    tomllib = pytest.importorskip("tomllib")
    hook, text = _hook(), (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    want = [c for c in tomllib.loads(text)["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    got = hook.contracts(text)
    assert len(got) == len(want) >= 6
    for g, w in zip(got, want):
        assert g["name"] == w["name"] and [c for c in [g["container"]] if c] == w.get("containers", [])
        assert [" | ".join(names) for names, _ in g["layers"]] == [layer.strip() for layer in w["layers"]]
        assert all(comment for _, comment in g["layers"]), f"a layer of {g['name']!r} has no comment"
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert page.count(hook.MARKER) == 1
    built = hook.on_page_markdown(page, None, None, None)
    assert hook.MARKER not in built and "integrations" in built and "_jit_mods" in built
    assert "qkv.core" in built and "blockmask" in built
