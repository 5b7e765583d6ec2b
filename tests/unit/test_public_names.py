"""The public module names stay what they were before the folders (issue 42): each resolves to the module of
its home itself — one object, imported once, with the home's name and spec — as a statement, by
``importlib`` and as an attribute of ``qkv``; a module under it too (``qkv.backends.tiled.plan``)."""
import importlib
import subprocess
import sys

import pytest

import qkv
from qkv import _public

#: every public module name qkv had as a top-level module or package before the layer folders
BEFORE = ("accuracy", "accuracy_table", "backends", "bench", "blockmask", "cache", "distributed", "flex", "gemm",
          "hf", "kernels", "lab", "masks", "merge", "mha", "mods", "paths", "pipeline", "plans", "positions",
          "sdpa", "shapes", "stages", "torch", "tracing")


def test_every_name_users_imported_still_has_a_home():
    assert sorted(n.removeprefix("qkv.") for n in _public.PUBLIC) == sorted(BEFORE)
    for name, home in _public.PUBLIC.items():
        assert importlib.util.find_spec(home) is not None, f"{name}'s home {home} does not exist"


@pytest.mark.parametrize("name", ["masks", "mods", "stages", "positions", "backends", "gemm", "kernels", "sdpa",
                                  "flex", "plans", "pipeline", "mha", "bench", "lab", "accuracy", "paths"])
def test_a_public_name_is_its_homes_module(name):
    home = importlib.import_module(_public.PUBLIC[f"qkv.{name}"])
    public = importlib.import_module(f"qkv.{name}")
    assert public is home and getattr(qkv, name) is home
    assert public.__name__ == public.__spec__.name == home.__name__
    assert sys.modules[f"qkv.{name}"] is home


def test_importing_a_module_by_its_public_name_leaves_its_package_alone():
    """``import qkv.backends.select`` must not rebind the package's function ``select`` to the module (as a first
    import of a new name would): run in a fresh process, where no test has imported it before."""
    code = ("import qkv.backends.select, qkv.backends.tiled.plan, qkv\n"
            "assert callable(qkv.backends.select), qkv.backends.select\n"
            "import qkv.engine.backends.tiled as t; assert qkv.backends.tiled.plan is t.plan\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_module_under_a_public_package_is_one_object():
    import qkv.backends.tiled.plan as by_public
    from qkv.engine.backends.tiled import plan as by_home
    assert by_public is by_home and by_public.__spec__.name == "qkv.engine.backends.tiled.plan"
    import qkv.backends.select
    import qkv.engine.backends.select
    assert sys.modules["qkv.backends.select"] is sys.modules["qkv.engine.backends.select"]
    assert callable(qkv.backends.select) and qkv.backends.select is qkv.engine.backends.select   # the function
    assert not isinstance(qkv.engine.backends.select, type(qkv))


def test_a_name_patched_through_one_is_patched_through_the_other(monkeypatch):
    import qkv.core.masks
    import qkv.masks
    monkeypatch.setattr("qkv.masks.causal", "patched")
    assert qkv.core.masks.causal == "patched"


def test_every_public_name_is_an_attribute_of_qkv_in_a_fresh_process():
    code = ("import qkv\n"
            "for n in ('kernels', 'gemm', 'sdpa', 'flex', 'tracing', 'pipeline', 'blockmask', 'merge', 'shapes', 'cache',"
            " 'mha', 'paths', 'plans', 'accuracy', 'bench'):\n"
            "    m = getattr(qkv, n); assert m.__name__.endswith('.' + n), (n, m)\n"
            "assert 'kernels' in dir(qkv)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_names_outside_the_table_are_left_to_python():
    assert _public.home("qkv.explain") is None and _public.home("numpy.linalg") is None
    assert _public.home("qkv.hf._record") == "qkv.integrations.hf._record"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("qkv.no_such_module")


def test_importing_qkv_imports_no_integration_or_tool():
    """The names are answered on first import: ``import qkv`` still loads neither torch nor the tools."""
    code = ("import sys, qkv; print(sorted(m for m in sys.modules if m.startswith(('torch', 'transformers', "
            "'qkv.integrations', 'qkv.tools'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
