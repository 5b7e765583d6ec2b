"""The layers: no import cycle among qkv's modules, counting every import anywhere in a module (inside functions
too), read with ``ast`` from ``src/qkv``. The layers themselves (which package may import which) are the
import-linter contracts in pyproject.toml (``lint-imports``, run by ``make test`` and ``make check``)."""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted((SRC / "qkv").rglob("*.py"))}


def _module_of(dotted: str) -> str | None:
    """The qkv module ``dotted`` names, or the module that defines it (``qkv.sdpa.attention`` → ``qkv.sdpa``)."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def imports(module: str) -> dict[str, int]:
    """The qkv modules ``module`` imports, each with the line of its first import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                frm = ".".join(base + ([node.module] if node.module else []))
            else:
                frm = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one, else a name defined in pkg
            targets = [f"{frm}.{a.name}" if f"{frm}.{a.name}" in MODULES else frm for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "qkv":
                continue
            resolved = _module_of(target)
            if resolved and resolved != module:
                found.setdefault(resolved, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    return {m: imports(m) for m in MODULES}


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle (``[a, b, …, a]``) or None: a module that reaches itself, shortest path first."""
    for start in sorted(edges):
        came_from: dict[str, str] = {}
        queue = deque(edges[start])
        for nxt in edges[start]:
            came_from.setdefault(nxt, start)
        while queue:
            node = queue.popleft()
            if node == start:
                path = [start]
                node = came_from[start]
                while node != start:
                    path.append(node)
                    node = came_from[node]
                return [start] + path[1:][::-1] + [start]
            for nxt in edges.get(node, ()):
                if nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
    return None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    edges = graph()
    assert len(edges) > 80 and "qkv.core.tracing" in edges
    assert "qkv.core.tracing" in edges["qkv.core.stages"]                       # from qkv.core.tracing import record
    assert "qkv.engine.backends.runtime" in edges["qkv.models.bert"]
    assert "qkv.tools.lab" in edges["qkv.viz.page"]                             # an import inside a function
    relative = tmp_path / "m.py"                                               # the code is absolute; a relative one
    relative.write_text("from .tracing import record\nfrom ..compute import gemm\n", encoding="utf-8")
    monkeypatch.setitem(MODULES, "qkv.core.m", relative)
    assert set(imports("qkv.core.m")) == {"qkv.core.tracing", "qkv.compute.gemm"}
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_no_import_cycle_among_qkv_modules():
    edges = graph()
    cycle = find_cycle(edges)
    if cycle:
        steps = [f"{a} → {b} ({MODULES[a].relative_to(SRC)}:{edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle:\n  " + "\n  ".join(steps))


def test_only_the_command_line_imports_the_pictures():
    # the rules the issue names, also without import-linter: the core reaches viz only through its display hook
    # (qkv._display, filled by qkv.viz), the lab returns data that viz draws, the models do not draw
    for module, targets in graph().items():
        if module.startswith(("qkv.viz", "qkv.cli")):
            continue
        upper = sorted(t for t in targets if t.startswith(("qkv.viz", "qkv.cli")))
        assert not upper, f"{module} imports {upper}"
