"""Notebook display: the hook the core offers and :mod:`qkv.viz` fills.

:class:`qkv.Trace` and the models' outputs have ``_repr_html_``, which asks :func:`html`; ``qkv.viz`` registers
its :func:`qkv.viz.show` here when it is imported (:func:`register`). The core never imports ``qkv.viz``: the
provider is named (:data:`PROVIDER`) and loaded by name on first display, as ``qkv.viz`` itself is loaded on
first attribute access, so an object shows itself in a notebook after a plain ``import qkv``.
"""
from __future__ import annotations

import importlib

__all__ = ["PROVIDER", "html", "register"]

#: The module that registers the display (imported by name the first time an object is displayed).
PROVIDER = "qkv.viz"

_show = None


def register(show) -> None:
    """Display objects with ``show(obj)``: it returns something with ``_repr_html_()``."""
    global _show
    _show = show


def html(obj) -> str | None:
    """``obj``'s notebook HTML from the registered display (loading :data:`PROVIDER` if none is yet)."""
    if _show is None:
        importlib.import_module(PROVIDER)
    if _show is None:                                             # pragma: no cover - a provider that registers nothing
        return None
    return _show(obj)._repr_html_()
