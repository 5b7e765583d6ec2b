"""The import layers, as import-linter cannot see them: a module imported by name (``importlib.import_module`` or
``__import__`` with a literal name) is held to the same contract as an ``import`` statement — a module imports
only from the layers below its own (pyproject.toml, ``[[tool.importlinter.contracts]]`` of type ``layers``). An
upward import by name needs an entry below, with the reason it is not a loop."""
import ast
import pathlib
import tomllib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PYPROJECT = SRC.parent / "pyproject.toml"

#: Upward imports by name that are the design, not a hidden loop: ``(importer, imported) -> why``.
ALLOWED = {
    ("qkv._display", "qkv.viz"): "the notebook hook: the core names its display provider, which registers itself; "
                                 "qkv.viz imports nothing of _display's layer back",
}


def _layers() -> list[list[str]]:
    conf = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["importlinter"]
    contract = next(c for c in conf["contracts"] if c["type"] == "layers")
    return [[m.strip() for m in layer.split("|")] for layer in contract["layers"]]


def _layer_of(module: str, layers) -> int | None:
    for i, layer in enumerate(layers):                        # 0 is the top
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return None


def _by_name(path: pathlib.Path):
    """``(module imported by name, line)`` of each ``import_module(...)`` / ``__import__(...)`` call whose name is a
    literal or a module-level string constant (``PROVIDER = "qkv.viz"``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        arg = node.args[0]
        value = arg.value if isinstance(arg, ast.Constant) else consts.get(getattr(arg, "id", None))
        if name in ("import_module", "__import__") and isinstance(value, str):
            yield value, node.lineno


def _module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_a_higher_layer_by_name():
    layers = _layers()
    found, upward = 0, []
    for path in sorted((SRC / "qkv").rglob("*.py")):
        importer = _module_of(path)
        for imported, line in _by_name(path):
            if not imported.startswith("qkv"):
                continue
            found += 1
            a, b = _layer_of(importer, layers), _layer_of(imported, layers)
            if a is not None and b is not None and b < a and (importer, imported) not in ALLOWED:
                upward.append(f"{path.relative_to(SRC)}:{line}: {importer} imports {imported} (a layer above) by name")
    assert found >= 1                                          # the scan sees the imports it is about (_display's)
    assert not upward, "\n".join(upward)


def test_the_scan_finds_an_upward_import_by_name(tmp_path):
    """Not vacuous: the lab importing qkv.viz by name, as its deprecated plot did, is a layer above it."""
    layers = _layers()
    p = tmp_path / "mod.py"
    p.write_text("import importlib\nimportlib.import_module('qkv.viz.lab_plots')\n", encoding="utf-8")
    (imported, _), = list(_by_name(p))
    assert _layer_of(imported, layers) < _layer_of("qkv.tools.lab", layers)


def _imported(path: pathlib.Path):
    """``(module, line)`` of every absolute ``import`` / ``from … import`` of a qkv module in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.startswith("qkv"))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("qkv"):
            yield node.module, node.lineno
            yield from ((f"{node.module}.{a.name}", node.lineno) for a in node.names)


def test_the_code_imports_homes_never_public_names():
    """``qkv.masks``, ``qkv.hf``, … are for users (qkv._public); inside src/qkv an import names the module's
    folder (``qkv.core.masks``), so that import-linter sees the edge — statements and imports by name alike."""
    from qkv import _public

    bad = []
    for path in sorted((SRC / "qkv").rglob("*.py")):
        names = list(_imported(path)) + list(_by_name(path))
        bad += [f"{path.relative_to(SRC)}:{line}: {name}" for name, line in names if _public.home(name)]
    assert not bad, "imports of public names inside qkv (import the home instead):\n" + "\n".join(bad)
