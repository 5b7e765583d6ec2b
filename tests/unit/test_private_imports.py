"""No module imports another package's private name. A package is a folder under ``src/qkv`` (``qkv.engine``,
``qkv.core``, ``qkv.integrations``, …); a private name is one that starts with ``_`` — a module
(``qkv.tools.lab._heads``) or a name in one (``qkv.engine.flex._prepare``). Inside its package a module may use
them; another package uses what the package exports. The root's own leaves (``qkv._checks``, ``qkv._files``,
``qkv._display``, …) are shared by every package. Read with ``ast``: ``from X import _y``, ``from X._m import
y`` and ``m._y`` where ``m`` is a module bound by an import."""
from __future__ import annotations

import ast
import pathlib

from test_layers import MODULES, SRC          # every qkv module by name, read from src/qkv (one scan)


def package(module: str) -> str:
    """``qkv.<folder>`` for a module inside a folder of qkv, else ``qkv`` (the root and its leaves)."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    return top if len(parts) >= 2 and MODULES.get(top, pathlib.Path()).name == "__init__.py" else "qkv"


def _private(segments) -> bool:
    return any(s.startswith("_") and not s.startswith("__") for s in segments)


def crossings(module: str, source: str) -> list[str]:
    """``"line: name"`` for each private name of another package that ``source`` (module ``module``) uses."""
    found, bound = [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("qkv"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in MODULES else node.module
                if full in MODULES:
                    bound[alias.asname or alias.name] = full
                where = package(target)
                inner = full.split(".")[len(where.split(".")):]
                if where not in ("qkv", package(module)) and _private(inner):
                    found.append(f"{node.lineno}: {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("qkv."):
                    bound[alias.asname or alias.name] = alias.name
                    where = package(alias.name)
                    if where not in ("qkv", package(module)) and _private(alias.name.split(".")[2:]):
                        found.append(f"{node.lineno}: {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            target = bound[node.value.id]
            if package(target) not in ("qkv", package(module)) and _private([node.attr]):
                found.append(f"{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_uses_another_packages_private_names():
    bad = [f"{MODULES[m].relative_to(SRC)}:{c}" for m in MODULES for c in crossings(m, MODULES[m].read_text("utf-8"))]
    assert not bad, "private names used across packages (export them from their package):\n" + "\n".join(bad)


def test_the_scan_sees_each_form_of_crossing():
    """Not vacuous: each form is found across packages, and none inside one or from the root's leaves."""
    src = ("from qkv.engine.flex import _prepare\n"
           "from qkv.tools.lab import _heads\n"
           "from qkv.integrations.hf._record import Recording\n"
           "from qkv.engine import sdpa\n"
           "import qkv.tools.lab._mask as m\n"
           "sdpa._validate\n"
           "from qkv._checks import check_int\n"
           "from qkv.core._x import y\n")
    assert [c.split(": ")[1] for c in crossings("qkv.viz.page", src)] == [
        "qkv.engine.flex._prepare", "qkv.tools.lab._heads", "qkv.integrations.hf._record.Recording",
        "qkv.tools.lab._mask", "qkv.core._x.y", "qkv.engine.sdpa._validate"]
    assert crossings("qkv.engine.plans", "from qkv.engine.flex import _prepare\nfrom qkv import _checks\n") == []
    assert package("qkv.engine.backends.tiled.plan") == "qkv.engine" and package("qkv._checks") == "qkv"


def unused_private_imports(source: str) -> list[str]:
    """Private names a module imports without using them: a shim re-exporting another module's privates."""
    tree = ast.parse(source)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {a.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) for a in [n.value] if isinstance(a, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qkv"):
            found += [f"{node.lineno}: {a.name}" for a in node.names
                      if _private([a.asname or a.name]) and (a.asname or a.name) not in used]
    return found


def test_no_module_re_exports_private_names():
    """The shims that kept private names importable from a module that had been split are gone: a private name
    is imported where it is used (tests import it from the module that defines it)."""
    bad = [f"{MODULES[m].relative_to(SRC)}:{c}" for m in MODULES
           for c in unused_private_imports(MODULES[m].read_text("utf-8"))]
    assert not bad, "private names imported and not used (a shim):\n" + "\n".join(bad)


def test_the_shim_scan_sees_an_unused_private_import():
    assert unused_private_imports("from qkv.explain._reading import _read, _parse_json\n_read(1)\n") == [
        "1: _parse_json"]
