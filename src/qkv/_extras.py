"""Optional dependencies, imported where they are used: a missing one is an ImportError of one line naming the
extra that brings it (pyproject.toml), never a bare ModuleNotFoundError."""
from __future__ import annotations

import types

import importlib

#: The optional dependencies and the extra that brings each.
EXTRAS = types.MappingProxyType(
    {"click": "cli", "rich": "cli", "yaml": "cli", "tqdm": "cli", "matplotlib": "viz", "networkx": "viz",
     "safetensors": "model", "tokenizers": "model", "gguf": "llama", "jinja2": "llama", "threadpoolctl": "fast",
     "numba": "jit", "mkl": "mkl", "torch": "torch"})


def need(module: str, what: str):
    """``import module`` for ``what`` (e.g. "qkv.viz.plot_lab"); ImportError naming the extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        extra = EXTRAS.get(top, "dev")
        raise ImportError(f"{what} needs {top}: pip install 'qkv[{extra}]'") from None
