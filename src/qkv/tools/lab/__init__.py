"""qkv lab: the seeds' claims, shown by experiment on qkv's own forward and backward.

Each experiment is a short, seeded function returning plain data (dicts and lists, JSON-ready); ``qkv lab
NAME`` prints it as a table, ``--json`` prints the same data, ``--plot FILE`` draws it (:func:`qkv.viz.plot_lab`,
the ``viz`` extra), and a paragraph (``--lang en|zh``) says what the numbers show.

    from qkv import lab
    r = lab.scale()        # ÷ √d_k: variance of q·k, softmax saturation, vanishing score gradients
    r = lab.mask()         # −∞ before softmax vs zeroing after, −1e9, −1e4 in float16, fully masked rows
    r = lab.heads()        # one head vs two heads of the same width on a task that needs two relations
    r = lab.train()        # a pronoun learns to find its noun: 它's q comes to match 树's k
    print(lab.paragraph("train", r, lang="zh"))

* :func:`scale` — :mod:`qkv.lab._scale`
* :func:`mask` — :mod:`qkv.lab._mask`
* :func:`heads` — :mod:`qkv.lab._heads`
* :func:`train` — :mod:`qkv.lab._train`; :func:`explain_train` writes ``qkv explain``'s calculation of the
  learned W_Q/W_K on 银行旁边有一棵树，它很高 (the pronoun's row).

The training loops are NumPy: the attention's gradients come from qkv's backward, the few other parts
(embeddings, a linear readout, cross-entropy) by the chain rule in :mod:`qkv.lab.common`.
"""
from __future__ import annotations

import types

from qkv.tools.lab import _heads, _mask, _scale, _train
from qkv.tools.lab._heads import kind_name
from qkv.tools.lab._mask import method_name
from qkv.tools.lab._scale import D_KS
from qkv.tools.lab._train import explain_trace

#: The experiments, in the order the command lists them.
NAMES = ("scale", "mask", "heads", "train")
_MODULES = types.MappingProxyType({"scale": _scale, "mask": _mask, "heads": _heads, "train": _train})

scale = _scale.run
mask = _mask.run
heads = _heads.run
train = _train.run


def _module(name: str):
    try:
        return _MODULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"name: expected one of {', '.join(NAMES)}, got {name!r}") from None


def paragraph(name: str, result: dict, lang: str = "en") -> str:
    """What the numbers of ``result`` (from experiment ``name``) show, in one paragraph in ``lang``."""
    return _module(name).paragraph(result, lang)


def table(name: str, result: dict, lang: str = "en"):
    """``(title, headers, rows)``: the result as a table of strings (what ``qkv lab NAME`` prints)."""
    return _module(name).table(result, lang)


def explain_train(result: dict, lang: str = "en", fmt: str = "text") -> str:
    """``qkv explain``'s calculation for 它 on 银行旁边有一棵树，它很高 with the weights ``train`` learned."""
    return _train.explain_text(result, lang, fmt)


__all__ = ["D_KS", "NAMES", "explain_trace", "explain_train", "heads", "kind_name", "mask", "method_name", "paragraph", "scale",
           "table", "train"]
