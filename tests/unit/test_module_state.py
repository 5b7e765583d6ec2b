"""No module-level mutable state (issue 42): a dict, list, set or bytearray assigned at a module's top level is
state every caller and thread shares. The engine's belongs to the runtime (qkv.backends.runtime: pools and
caches, locked and bounded) or to the configuration (qkv.config: one context variable); a constant is a tuple,
frozenset or types.MappingProxyType. What remains is on a short list, each with its reason."""
import ast
import pathlib

import qkv

#: The module-level mutables (dict, list, set, bytearray assigned at module level) allowed, and why. Every
#: other one is a defect: make a constant a tuple, frozenset or types.MappingProxyType, and state the runtime's
#: (qkv.backends.runtime) or the configuration's (qkv.config).
ALLOWED = {
    "engine/backends/registry.py:BACKENDS": "the backend registry: written by register() under the registry's lock",
    "engine/backends/registry.py:_BUILTIN": "the built-in backends, filled once under the registry's lock",
    "compute/paths.py:_PATHS": "the path registry: written at import, under paths._LOCK",
    "compute/paths.py:_OPEN": "the open counting() blocks, process-wide by design (workers count into them), under _LOCK",
    "compute/gemm.py:_NUMPY_SGEMM": "NumPy's C sgemm, found once (an idempotent write); the tests' seam for another BLAS",
    "compute/_jit.py:_FLAGS": "numba's fastmath flags, read by the decorators at import (part of numba's cache key)",
    "compute/_jit.py:_OPTS": "numba's njit options, read by the decorators at import",
    "compute/_jit.py:_EXACT": "numba's njit options without fastmath, read by the decorators at import",
    "compute/gemm.py:_tl": "threading.local: each thread's own MKL single-thread depth (thread state, never shared)",
    "compute/kernels.py:_held": "threading.local: whether this thread asked for numba on one thread before numba was imported",
    "cli/generate_cmd.py:_MODELS": "the command line's loaded models, one per file (one command, one thread)",
    "cli/model_cmd.py:_MODEL": "the command line's loaded encoder (one command, one thread)",
    # issue 41's files (transformers, pictures, locales), left to that work:
    "locales/__init__.py:_ADDED": "locale files added at run time (issue 41's module)",
    "locales/__init__.py:_CACHE": "the loaded locale files (issue 41's module)",
    "cli/viz_cmd.py:_VIEW_OPTIONS": "a constant table (issue 41's module)",
    "viz/heads.py:LETTERS": "a constant table (issue 41's module)",
    "viz/heatmap.py:FORMATS": "a constant table (issue 41's module)",
    "viz/lab_plots.py:PLOTS": "a constant table (issue 41's module)",
    "viz/page_data.py:REQUIRED": "a constant table (issue 41's module)",
}
_MUTABLE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "local"}


def module_mutables(root: pathlib.Path) -> dict:
    """``{"path:NAME": line}`` of every dict/list/set/bytearray/threading.local (literal, comprehension or
    constructor call) assigned at the module level of a file under ``root``; ``__all__`` (the export list) left out."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            v = node.value
            call = isinstance(v, ast.Call) and getattr(v.func, "id", getattr(v.func, "attr", None)) in _MUTABLE_CALLS
            if not (isinstance(v, _MUTABLE) or call):
                continue
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and target.id != "__all__":
                    found[f"{path.relative_to(root).as_posix()}:{target.id}"] = node.lineno
    return found


def test_no_module_level_mutable_outside_the_allow_list():
    root = pathlib.Path(qkv.__file__).parent
    found = module_mutables(root)
    extra = sorted(f"{k} (line {n})" for k, n in found.items() if k not in ALLOWED)
    assert not extra, f"module-level mutable state outside the runtime and the configuration: {extra}"
    assert not sorted(set(ALLOWED) - set(found)), "allowed but gone: take it off the list"


def test_the_scan_finds_what_it_should(tmp_path):
    (tmp_path / "m.py").write_text("import collections\n__all__ = ['a']\nA = {}\nB: list = []\nC = (1,)\n"
                                   "D = collections.defaultdict(list)\nE = frozenset({1})\nF = bytearray(2)\n"
                                   "G = {k: 1 for k in 'ab'}\nimport threading\nH = threading.local()\n")
    assert set(module_mutables(tmp_path)) == {"m.py:A", "m.py:B", "m.py:D", "m.py:F", "m.py:G", "m.py:H"}


#: Module names a function rebinds (``global``), and why.
REBOUND = {
    "_display.py:_show": "the notebook display qkv.viz registers once (a lower layer's hook)",
    "compute/gemm.py:_blas_single_threaded": "the runtime's counted BLAS limit, installed once when it is made (a hook: "
                                     "gemm sits below the runtime)",
    "viz/heatmap.py:_warned_no_cjk": "a warn-once flag (issue 41's module)",
}


def module_rebinds(root: pathlib.Path) -> set:
    """``"path:NAME"`` of every module-level name a function of a file under ``root`` declares ``global``."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Global):
                found |= {f"{path.relative_to(root).as_posix()}:{name}" for name in node.names}
    return found


def test_no_function_rebinds_a_module_name_outside_the_list():
    found = module_rebinds(pathlib.Path(qkv.__file__).parent)
    assert not sorted(found - set(REBOUND)), "a module name rebound at run time: state outside the runtime"
    assert not sorted(set(REBOUND) - found), "allowed but gone: take it off the list"


def test_the_rebind_scan_finds_what_it_should(tmp_path):
    (tmp_path / "m.py").write_text("X = 1\ndef f():\n    global X\n    X = 2\ndef g():\n    return X\n")
    assert module_rebinds(tmp_path) == {"m.py:X"}
