"""The public module names, and the folder each lives in.

qkv's code is laid out by layer (``compute``, ``core``, ``engine``, ``nn``, ``integrations``, ``tools``, …),
while its public module names stay those users import: ``qkv.masks``, ``qkv.mods``, ``qkv.hf``,
``qkv.backends.select``, ``qkv.torch``, … :data:`PUBLIC` maps each such name to its home, and
:func:`install` puts a finder first on ``sys.meta_path`` that answers ``import qkv.<name>[.<sub>]`` with the
module of its home itself — the same object, so a name patched through one is patched through the other, and
no second copy is ever imported. Inside ``src/qkv`` only the homes are imported (a test holds it), so
import-linter sees every edge. This module imports nothing of qkv.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import MappingProxyType

#: public name -> the module or package that implements it
PUBLIC = MappingProxyType({
    **{f"qkv.{m}": f"qkv.core.{m}" for m in
       ("blockmask", "cache", "masks", "merge", "mods", "pipeline", "positions", "shapes", "stages", "tracing")},
    **{f"qkv.{m}": f"qkv.compute.{m}" for m in ("gemm", "kernels", "paths")},
    **{f"qkv.{m}": f"qkv.engine.{m}" for m in ("backends", "flex", "plans", "sdpa")},
    "qkv.mha": "qkv.nn.mha",
    **{f"qkv.{m}": f"qkv.integrations.{m}" for m in ("distributed", "hf", "torch")},
    **{f"qkv.{m}": f"qkv.tools.{m}" for m in ("accuracy", "accuracy_table", "bench", "lab")},
})


def home(name: str) -> str | None:
    """The module that implements the public name ``name`` (or a module under it), or None."""
    head, dot, rest = name.partition(".")
    if head != "qkv" or not dot:
        return None
    top = "qkv." + rest.partition(".")[0]
    target = PUBLIC.get(top)
    return None if target is None else target + name[len(top):]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers a public name with its home's module object (imported once, under its home's name)."""

    def find_spec(self, fullname, path=None, target=None):
        real = home(fullname)
        if real is None:
            return None
        found = importlib.util.find_spec(real)          # located, not run: a missing extra fails at import
        if found is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=real,
                                               is_package=found.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(spec.origin)
        spec.loader_state = module.__spec__              # the home's own spec, put back by exec_module
        return module

    def exec_module(self, module):
        alias = module.__spec__.name
        # the import system set __spec__ (and nothing else) to the public name's spec: give the home's back
        module.__spec__ = module.__spec__.loader_state
        # The modules already loaded under a package get their public names now: importing one later finds it
        # in sys.modules, so the import system never sets it as an attribute of its package — where a package
        # binds a function of the same name (qkv.backends.select, the function), it stays the function.
        home = module.__name__
        for name, sub in list(sys.modules.items()):
            if name.startswith(home + "."):
                sys.modules.setdefault(alias + name[len(home):], sub)


_FINDER = _Finder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
