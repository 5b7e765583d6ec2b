"""Worked examples: the built-in ones (``qkv examples``) and files in the worked-example format.

A worked example is a starting point (token vectors ``X`` with ``W_Q``, ``W_K``, ``W_V``; or ``Q`` and ``K``
(and ``V``) directly; or ``scores`` (and ``V``)), an optional mask and head count, and optionally the numbers
someone claims for the later steps (``claims``), which :func:`qkv.explain.check` verifies.

File format (YAML or JSON)::

    title: optional text
    tokens: [我, 爱, 吃]        # labels of the query rows (and key rows in self-attention)
    kv_tokens: [...]            # labels of the key/value rows in cross-attention
    X: [[...], ...]             # query-side token vectors; Q = X·W_Q, K = X_kv·W_K, V = X_kv·W_V
    X_kv: [[...], ...]          # key/value-side vectors (cross-attention); default X
    W_Q: [[...]]                # likewise W_K, W_V
    #   or Q, K (and V) given directly;  or scores (and V)
    d_k: 3                      # the d in √d_k; default the key width
    mask: causal                # or a boolean matrix (true = may attend)
    heads: 2                    # several heads (needs X and square W_Q); W_O optional (default identity)
    rope: {theta: 10000, style: neox}   # RoPE on Q and K (positions: [...], kv_positions: [...] optional)
    alibi: true                 # ALiBi slopes from the head count, or a list (one per head)
    softcap: 30                 # capped = 30·tanh(s / 30)
    window: 3                   # causal sliding window; prefix: N (prefix LM); documents: [2, 3] or {ids: [...]}
    sinks: 1                    # the first N keys visible to every query (or-ed with the other mask keys)
    sink_logits: [0.0]          # learned softmax sinks, one per head
    claims: {Q: {爱: [0.05, 0.23, 0.41]}, weights: [[...], ...]}   # also Q_rot, K_rot, biased, capped
    tolerance: 0.001            # absolute tolerance for every claim (default: the precision as written)

Loading is safe: YAML goes through a ``SafeLoader`` subclass (no tag constructs an object; libyaml's
``CSafeLoader`` when PyYAML has it), numbers keep the text they were written with (``0.50`` has two decimals),
and anything unusable raises :class:`WorkedExampleError` with one line naming the key, the row and what was
expected vs found — a file nested too deeply too (no RecursionError), and one that expands to more than
4,000,000 numbers (an alias counted as everything it stands for: :mod:`qkv.explain._bound`).

Large files load fast: a YAML row written in flow style on one line (``- [0.1, -0.2, 3]``, ``X: [[1, 2], [3,
4]]``) whose items are all plain decimal numbers is read by a regular expression, each number kept with its
text, and the rest of the document by the YAML loader (a 5 MB YAML file loads within a few times the JSON
time, instead of 10×: no YAML node, mark or resolver call per number).
"""
from __future__ import annotations

import types

from importlib import resources

# The worked example's parts, one concern a module (_numbers, _fields, _reading, _schema, _claims, _options,
# _worked, _run); this module loads files and built-ins, and exports the public names.
from qkv.explain._numbers import Number, WorkedExampleError, half_unit, text_of
from qkv.explain._reading import _parse_yaml, _read
from qkv.explain._run import is_large, run, run_rows
from qkv.explain._schema import from_dict
from qkv.explain._worked import CLAIM_NAMES, KEY_SIDE, Worked

__all__ = ["Worked", "WorkedExampleError", "builtin_names", "load_example", "load_file", "from_dict", "run",
           "run_rows", "is_large", "CLAIM_NAMES", "KEY_SIDE", "Number", "half_unit", "text_of", "TITLE_KEYS", "titles"]


# ----------------------------------------------------------------------------------------------- loading
def load_file(path) -> Worked:
    """Read and validate a worked-example file (YAML, or JSON when the name ends in ``.json``)."""
    doc, where = _read(path)
    return from_dict(doc, name=where, where=where)


def _examples_dir():
    return resources.files("qkv") / "examples"


def builtin_names() -> list[str]:
    """The built-in examples' names, ``seed003`` (the default) first."""
    names = sorted(p.name[:-5] for p in _examples_dir().iterdir() if p.name.endswith(".yaml"))
    order = ["seed003", "seed000", "seed002"]
    return [n for n in order if n in names] + [n for n in names if n not in order]


def load_example(name: str) -> Worked:
    """A built-in example by name (see :func:`builtin_names`)."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    names = builtin_names()
    if name not in names:
        raise WorkedExampleError(f"example: no built-in example {name!r}; expected one of {', '.join(names)}")
    ref = _examples_dir() / f"{name}.yaml"
    doc = _parse_yaml(ref.read_text(encoding="utf-8"), f"{name}.yaml")
    return from_dict(doc, name=name, where=f"{name}.yaml")


#: Each built-in example's title in every language: its key in qkv/locales (en.json holds the YAML file's title).
TITLE_KEYS = types.MappingProxyType(
    {"alibi": "explain.example_alibi", "causal": "explain.example_causal", "cross": "explain.example_cross",
     "document": "explain.example_document", "padding": "explain.example_padding",
     "rope": "explain.example_rope", "seed000": "explain.example_seed000",
     "seed002": "explain.example_seed002", "seed003": "explain.example_seed003",
     "sinks": "explain.example_sinks", "sliding_window": "explain.example_sliding_window",
     "softcap": "explain.example_softcap", "two_head": "explain.example_two_head"})


def titles(worked: Worked) -> dict[str, str] | None:
    """A built-in example's title in each language (``{"en": …, "zh": …}``, :mod:`qkv.locales`) while its title
    is the built-in's; None for any other title (a file's, or one set by the user), which stays as written."""
    from qkv import locales

    key = TITLE_KEYS.get(worked.name) if isinstance(worked.name, str) else None
    if key is None or worked.title != locales.t(key, "en"):
        return None
    return {lang: locales.t(key, lang) for lang in locales.langs()}
