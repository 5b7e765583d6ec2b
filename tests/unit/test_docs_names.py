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
        return not rest or rest[0] in _top_level_names(pathlib.Path(importlib.util.find_spec(module).origin))
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


def contract_layers():
    """The layers contract's layers, top down, each a set of module names without ``qkv.``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r'type = "layers"\s*\nlayers = \[(.*?)\n\]', text, re.S).group(1)
    return [{m.strip().removeprefix("qkv.") for m in layer.split("|")} for layer in re.findall(r'"([^"]+)"', block)]


def page_layers():
    """The architecture page's list: the first fenced block under "## The layers"; a line that starts in column
    0 names a layer's modules in its first 30 columns (a name column ending in "," goes on on the next line)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## The layers", 1)[1]
    block = section.split("```\n", 2)[1]
    layers, open_entry = [], False
    for line in block.splitlines():
        if not line[:1].strip():
            continue
        names = [n.strip().rstrip("/") for n in line[:30].split(",") if n.strip()]
        if open_entry:
            layers[-1] |= set(names)
        else:
            layers.append(set(names))
        open_entry = line[:30].rstrip().endswith(",")
    return layers


def test_the_architecture_page_lists_the_contracts_layers():
    want, got = contract_layers(), page_layers()
    assert len(want) > 10
    assert got == want, "docs/architecture.md's layers differ from pyproject.toml's contract:\n" + "\n".join(
        f"  page {sorted(g)} / contract {sorted(w)}" for g, w in zip(got + [set()] * len(want), want) if g != w)
