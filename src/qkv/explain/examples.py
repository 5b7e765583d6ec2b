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

import functools
import json
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from importlib import resources
from typing import Any

import numpy as np

from ..stages import PIPELINE_ORDER, Names
from ._bound import bound

__all__ = ["Worked", "WorkedExampleError", "builtin_names", "load_example", "load_file", "from_dict", "run",
           "run_rows", "is_large", "CLAIM_NAMES", "KEY_SIDE", "Number", "half_unit", "text_of", "TITLE_KEYS", "titles"]

#: The steps a worked example may claim numbers for, in pipeline order (:data:`qkv.stages.PIPELINE_ORDER`
#: without ``modified`` — no custom score mod in a file — and ``masked``, whose −∞ is not a number to claim).
CLAIM_NAMES = tuple(n for n in PIPELINE_ORDER if n not in (Names.MODIFIED, Names.MASKED))
#: The claimable steps whose rows are keys (labelled by ``kv_tokens``), not queries.
KEY_SIDE = (Names.K, Names.V, Names.K_ROT)

#: The keys of the attention variants (RoPE, ALiBi, soft-capping, mask mods, sinks); see :func:`from_dict`.
VARIANT_KEYS = ("rope", "alibi", "softcap", "window", "prefix", "documents", "sinks", "sink_logits")
_KNOWN_KEYS = ("title", "description", "tokens", "kv_tokens", "X", "X_kv", "W_Q", "W_K", "W_V", "W_O", "Q",
               "K", "V", "scores", "d_k", "mask", "heads", "claims", "tolerance") + VARIANT_KEYS
_ROPE_KEYS = ("theta", "style", "positions", "kv_positions")
_ROPE_STYLES = ("neox", "interleaved")
_MAX_BYTES = 16 * 1024 * 1024
_MAX_ELEMENTS = 4_000_000


class WorkedExampleError(ValueError):
    """A worked example that cannot be used; the message is one line: where (key, row) and expected vs found."""


# ----------------------------------------------------------------------------------------------- numbers
class Number(float):
    """A float that remembers the text it was written as (``Number(0.5, "0.50").text == "0.50"``)."""

    __slots__ = ("text",)                      # no __dict__: a large file's numbers take a third of the memory
    text: str

    def __new__(cls, value, text: str | None = None):
        obj = super().__new__(cls, value)
        obj.text = text if text is not None else repr(float(value))
        return obj

    def __reduce__(self):
        return (Number, (float(self), self.text))


class _Int(int):
    """An int (from a file) that remembers its text; used for keys and scalars such as ``d_k``."""

    text: str

    def __new__(cls, value, text: str | None = None):
        obj = super().__new__(cls, value)
        obj.text = text if text is not None else str(int(value))
        return obj


class _YamlBool(str):
    """A YAML boolean (``true``, ``no``, ...) kept as its text, so ``no`` stays a usable token label."""

    value: bool

    def __new__(cls, text: str, value: bool):
        obj = super().__new__(cls, text)
        obj.value = value
        return obj


#: Integers written with more digits than this are read as an infinite Number (int() refuses over 4,300
#: digits with a message about sys.set_int_max_str_digits; no such number fits in a float64 anyway).
_MAX_INT_TEXT = 4000


def _int_of(text: str):
    """An integer's text as an _Int; one too long for int() (and for float64) as an infinite Number, so the
    key that holds it is reported ("expected a finite number")."""
    if len(text) > _MAX_INT_TEXT:
        return Number(math.copysign(math.inf, -1.0 if text.lstrip().startswith("-") else 1.0), text)
    return _Int(int(text), text)


def _short(text: str, n: int = 24) -> str:
    """A number's text cut for a message: ``123456789012…(100000 digits)``."""
    text = str(text)
    return text if len(text) <= n else f"{text[:n - 12]}…({len(text)} characters)"


def text_of(x) -> str:
    """The text a number was written as (files), or its shortest repr (numbers given from Python)."""
    t = getattr(x, "text", None)
    if t is not None:
        return t
    if isinstance(x, numbers.Integral):
        return str(int(x))
    return repr(float(x))


def half_unit(x) -> float:
    """Half a unit in the last decimal place of ``x`` as written: ``0.39`` → 0.005, ``0.50`` → 0.005,
    ``1`` → 0.5, ``1.5e-3`` → 0.00005."""
    t = text_of(x).replace("_", "").strip()
    try:
        exp = Decimal(t).as_tuple().exponent
    except (InvalidOperation, ValueError):
        return 0.5
    if not isinstance(exp, int):
        return 0.5
    return 0.5 * 10.0 ** exp


# ----------------------------------------------------------------------------------------------- YAML / JSON
def _yaml_loader():
    try:
        import yaml
    except ImportError:                                           # pragma: no cover - without the cli extra
        raise ImportError("reading worked-example files needs PyYAML: pip install 'qkv[cli]'") from None

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when PyYAML was built with it
        """SafeLoader whose numbers keep their text; ``1e-3`` is a float (YAML 1.1 would make it a string)."""

    def construct_float(loader, node):
        return Number(yaml.SafeLoader.construct_yaml_float(loader, node), node.value)

    def construct_int(loader, node):
        if len(node.value) > _MAX_INT_TEXT:                       # int() would refuse it, naming no key
            return _int_of(node.value)
        return _Int(yaml.SafeLoader.construct_yaml_int(loader, node), node.value)

    def construct_bool(loader, node):
        return _YamlBool(node.value, yaml.SafeLoader.construct_yaml_bool(loader, node))

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue                                          # SafeLoader reports unhashable keys itself
            if key in seen:
                m = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {str(key)!r} (line {seen[key] + 1} and line {m.line + 1})", m)
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: _map(loader, node, construct_mapping))
    Loader.add_constructor("tag:yaml.org,2002:float", construct_float)
    Loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    Loader.add_constructor("tag:yaml.org,2002:bool", construct_bool)
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return yaml, Loader


def _map(loader, node, construct_mapping):
    data = {}
    yield data
    data.update(construct_mapping(loader, node))


def _one_line(s: str) -> str:
    return " ".join(str(s).split())


#: One plain decimal number as YAML 1.1 (and qkv's resolver for ``1e-3``) reads it: an int (no leading zeros:
#: ``012`` is octal there) or a float. Anything else (``0x1F``, ``1_000``, ``.inf``, ``1:30``) takes the YAML path.
_YAML_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)\Z")
_YAML_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+|\.[0-9]+(?:[eE][-+][0-9]+)?)\Z")
#: A line whose value is flow-style numbers only: dashes, an optional plain key, then only [ ] digits , . e E + −.
_FLOW_LINE = re.compile(r"^(?P<pre>[ \t]*(?:-[ \t]+)*(?:[^\s\"'#\[\]{},&*!|>%@`:][^\"'#\[\]{}]*?:[ \t]+)?(?:-[ \t]+)*)"
                        r"(?P<flow>\[[\[\]0-9 \t,.eE+\-]*)$")
_INNER_SEQ = re.compile(r"\[([^\[\]]*)\]")


def _fast_rows(text: str):
    """Replace every one-line flow sequence of plain numbers with a placeholder scalar; return the new text and
    {placeholder: (the numbers as Number/_Int, the original text)}."""
    import secrets

    tag = f"__qkvrow{secrets.token_hex(4)}"
    rows: dict[str, tuple[list, str]] = {}

    def seq(m):
        parts = [p.strip() for p in m.group(1).split(",")]
        out = []
        for p in parts:
            if _YAML_INT.match(p):
                out.append(_int_of(p))
            elif _YAML_FLOAT.match(p):
                out.append(Number(float(p), p))
            else:
                return m.group(0)                                 # not plain numbers (or empty): YAML reads it
        key = f"{tag}_{len(rows)}__"
        rows[key] = (out, m.group(0))
        return key

    lines = text.split("\n")
    for n, line in enumerate(lines):
        if "[" not in line:
            continue
        m = _FLOW_LINE.match(line)
        if m:
            lines[n] = m.group("pre") + _INNER_SEQ.sub(seq, m.group("flow"))
    return ("\n".join(lines), rows, tag) if rows else (text, rows, tag)


def _put_rows(doc, rows: dict, tag: str):
    """The parsed document with each placeholder put back: a whole scalar → its numbers; inside a longer string
    (a block scalar's line) → its original text. Iterative (no recursion on deep documents)."""
    if not rows:
        return doc

    def fix(v):
        if isinstance(v, str) and tag in v:
            if v in rows:
                return list(rows[v][0])
            return re.sub(re.escape(tag) + r"_\d+__", lambda m: rows[m.group(0)][1] if m.group(0) in rows
                          else m.group(0), v)
        return v

    doc = fix(doc)
    stack = [doc]
    while stack:
        c = stack.pop()
        if isinstance(c, list):
            for i, v in enumerate(c):
                c[i] = fix(v)
                if isinstance(v, (list, dict)):
                    stack.append(v)
        elif isinstance(c, dict):
            for k, v in c.items():
                c[k] = fix(v)
                if isinstance(v, (list, dict)):
                    stack.append(v)
    return doc


def _parse_yaml(text: str, where: str):
    yaml, Loader = _yaml_loader()
    text, rows, tag = _fast_rows(text)
    try:
        doc = yaml.load(text, Loader=Loader)                       # noqa: S506 - a SafeLoader subclass
        bound(doc, where, WorkedExampleError, rows=rows)            # aliases expanded: before anything walks it
        return _put_rows(doc, rows, tag)
    except RecursionError:
        raise WorkedExampleError(f"{where}: nested too deeply (lists or mappings inside each other hundreds of "
                                 f"levels down); expected a worked example (matrices are lists of rows)") from None
    except yaml.constructor.ConstructorError as e:
        tag = getattr(e, "problem", "") or ""
        if tag.startswith("duplicate key"):
            raise WorkedExampleError(f"{where}: {tag}; expected each key once") from None
        m = re.search(r"tag '([^']*)'", tag)
        mark = e.problem_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        found = m.group(1).replace("tag:yaml.org,2002:", "!!") if m else _one_line(tag)
        raise WorkedExampleError(f"{where}: YAML tag {found} is not allowed{at}; expected plain data (safe "
                                 "loading: nothing in a file constructs objects or runs)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise WorkedExampleError(f"{where}: malformed YAML{at}: {_one_line(problem)}") from None


def _parse_json(text: str, where: str):
    def bad_constant(name):
        raise WorkedExampleError(f"{where}: expected finite numbers, found {name}")

    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise WorkedExampleError(f"{where}: duplicate key {k!r}; expected each key once")
            out[k] = v
        return out

    try:
        doc = json.loads(text, parse_float=lambda t: Number(float(t), t), parse_int=_int_of,
                         parse_constant=bad_constant, object_pairs_hook=pairs)
        bound(doc, where, WorkedExampleError)
        return doc
    except RecursionError:
        raise WorkedExampleError(f"{where}: nested too deeply (lists or objects inside each other thousands of "
                                 f"levels down); expected a worked example (matrices are lists of rows)") from None
    except json.JSONDecodeError as e:
        raise WorkedExampleError(f"{where}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def _read(path) -> tuple[Any, str]:
    path = os.fspath(path)
    where = os.path.basename(path) or path
    with open(path, "rb") as fh:                                  # OSError (missing, unreadable) propagates
        data = fh.read(_MAX_BYTES + 1)
    if len(data) > _MAX_BYTES:
        raise WorkedExampleError(f"{where}: file too large (over {_MAX_BYTES // (1024 * 1024)} MiB) for a "
                                 "worked example")
    if b"\x00" in data:
        raise WorkedExampleError(f"{where}: binary file (NUL bytes); expected YAML or JSON text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise WorkedExampleError(f"{where}: not UTF-8 text (byte {e.start}); expected YAML or JSON") from None
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise WorkedExampleError(f"{where}: empty file; expected a worked example (X and W_Q/W_K/W_V, or Q "
                                 "and K, or scores)")
    import gc

    enabled = gc.isenabled()
    gc.disable()                   # a parse makes one object per number and no cycles: no collection passes
    try:
        if path.lower().endswith(".json"):
            doc = _parse_json(text, where)
        else:
            doc = _parse_yaml(text, where)
    finally:
        if enabled:
            gc.enable()
    return doc, where


# ----------------------------------------------------------------------------------------------- the dataclass
@dataclass
class Worked:
    """A worked example, validated: arrays are float64 NumPy arrays, claims keep the numbers as written.

    ``claims`` maps a step name (one of :data:`CLAIM_NAMES`) to ``{row index: [number or None, ...]}``;
    each number is a :class:`Number` (a float that keeps its text). ``tokens`` always has one label per
    query row (``#0``, ``#1``, ... when the file gives none; ``tokens_given`` says which).
    ``kv_tokens`` labels the key rows in cross-attention (None in self-attention).
    """

    title: str | None = None
    tokens: list[str] | None = None
    kv_tokens: list[str] | None = None
    X: np.ndarray | None = None
    X_kv: np.ndarray | None = None
    W_Q: np.ndarray | None = None
    W_K: np.ndarray | None = None
    W_V: np.ndarray | None = None
    Q: np.ndarray | None = None
    K: np.ndarray | None = None
    V: np.ndarray | None = None
    scores: np.ndarray | None = None
    d_k: float | None = None
    mask: Any = None                       # "causal", a bool ndarray (L, S) (True = may attend), or None
    heads: int = 1
    W_O: np.ndarray | None = None
    claims: dict = field(default_factory=dict)
    tolerance: float | None = None
    description: str | None = None
    name: str | None = None                # the built-in name, or the file name
    tokens_given: bool = False
    kv_tokens_given: bool = False
    # the variants (None: not used)
    rope: dict | None = None               # {"theta": float, "style": "neox" | "interleaved"}
    positions: np.ndarray | None = None    # (L,) the queries' RoPE positions (default 0 … L−1)
    kv_positions: np.ndarray | None = None  # (S,) the keys' (default: the queries' in self-attention, else 0 … S−1)
    alibi: Any = None                      # True (slopes from the head count) or an (H,) array of slopes
    softcap: float | None = None           # c in c·tanh(s / c)
    window: int | None = None              # causal sliding window of this many keys
    prefix: int | None = None              # prefix LM: the first N keys visible to every query, the rest causal
    documents: np.ndarray | None = None    # (S,) the document id of each position
    sinks: int | None = None               # the first N keys visible to every query (or-ed with the other mask)
    sink_logits: np.ndarray | None = None  # (H,) learned sink logits in the softmax denominator

    @property
    def has_mask_mods(self) -> bool:
        """True when a mask key beyond ``mask`` (window, prefix, documents, sinks) is set."""
        return any(x is not None for x in (self.window, self.prefix, self.documents, self.sinks))

    def mask_matrix(self, mask=None):
        """The mask the runner applies, as data: ``"causal"``, a bool (L, S) matrix (True = may attend), or
        None. With window/prefix/documents/sinks it is their mask mod evaluated on (L, S); ``mask`` overrides
        the file's ``mask:`` key as in :func:`run`."""
        m = _resolve_mask(self, mask)
        if not self.has_mask_mods:
            return m
        from .. import mods, pipeline
        L, S = self.n_queries, self.n_keys
        b, h, q_idx, kv_idx = pipeline.indices((), L, S)
        dense = mods.call_mask_mod(_mask_mod(self, m, L, S), b, h, q_idx, kv_idx)
        return np.array(np.broadcast_to(dense, (L, S)))

    @property
    def has_variants(self) -> bool:
        return self.has_mask_mods or any(x is not None for x in (self.rope, self.alibi, self.softcap,
                                                                 self.sink_logits))

    # -------- derived facts
    @property
    def start(self) -> str:
        """The starting point: ``"X"``, ``"QK"`` or ``"scores"``."""
        if self.X is not None:
            return "X"
        if self.Q is not None:
            return "QK"
        return "scores"

    @property
    def is_cross(self) -> bool:
        if self.start == "X":
            return self.X_kv is not None
        if self.start == "QK":
            return self.K.shape[0] != self.Q.shape[0] or self.kv_tokens_given
        return self.scores.shape[1] != self.scores.shape[0] or self.kv_tokens_given

    @property
    def n_queries(self) -> int:
        return {"X": lambda: self.X.shape[0], "QK": lambda: self.Q.shape[0],
                "scores": lambda: self.scores.shape[0]}[self.start]()

    @property
    def n_keys(self) -> int:
        if self.start == "X":
            return (self.X if self.X_kv is None else self.X_kv).shape[0]
        if self.start == "QK":
            return self.K.shape[0]
        return self.scores.shape[1]

    @property
    def key_labels(self) -> list[str]:
        """Labels of the key/value rows: ``kv_tokens``, or the tokens in self-attention."""
        if self.kv_tokens is not None:
            return list(self.kv_tokens)
        if self.tokens is not None and len(self.tokens) == self.n_keys:
            return list(self.tokens)
        return [f"#{j}" for j in range(self.n_keys)]

    def key_width(self) -> int | None:
        if self.start == "X":
            return self.W_K.shape[1]
        if self.start == "QK":
            return self.K.shape[1]
        return None


# ----------------------------------------------------------------------------------------------- validation
def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _number(x, where: str):
    if isinstance(x, _YamlBool) or isinstance(x, (bool, np.bool_)):
        raise WorkedExampleError(f"{where}: expected a number, found {str(x).lower() if isinstance(x, bool) else x}")
    if not _is_number(x):
        found = "nothing (null)" if x is None else (f"{x!r}" if isinstance(x, str) else type(x).__name__)
        raise WorkedExampleError(f"{where}: expected a number, found {found}")
    if not math.isfinite(float(x)):
        raise WorkedExampleError(f"{where}: expected a finite number, found {_short(text_of(x))}")
    return x


def _matrix(value, key: str, where: str, *, allow_vector: str | None = None) -> np.ndarray:
    """A rectangular matrix of finite numbers → float64 (rows, cols).

    allow_vector: "row" accepts a flat list as one row, "column" as one column.
    """
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a matrix (a list of rows), found "
                                 f"{_describe(value)}")
    if len(value) == 0:
        raise WorkedExampleError(f"{where}: {key}: expected a matrix with at least one row, found an empty list")
    first = value[0] if isinstance(value[0], (list, tuple)) else value
    if len(value) * len(first) > _MAX_ELEMENTS:
        raise WorkedExampleError(f"{where}: {key}: expected at most {_MAX_ELEMENTS} numbers in a worked example, "
                                 f"found {len(value)}×{len(first)}")
    if all(not isinstance(r, (list, tuple)) for r in value) and allow_vector:
        for j, x in enumerate(value):
            _number(x, f"{where}: {key}[{j}]")
        arr = np.array([float(x) for x in value], dtype=np.float64)
        return arr[None, :] if allow_vector == "row" else arr[:, None]
    width = None
    for i, row in enumerate(value):
        if not isinstance(row, (list, tuple)):
            raise WorkedExampleError(f"{where}: {key} row {i}: expected a list of numbers, found {_describe(row)}")
        if width is None:
            width = len(row)
            if width == 0:
                raise WorkedExampleError(f"{where}: {key} row 0: expected at least one number, found an empty row")
        elif len(row) != width:
            raise WorkedExampleError(f"{where}: {key} row {i}: expected {width} numbers (as row 0), found "
                                     f"{len(row)} (ragged matrix)")
        if not all(type(x) in _PLAIN_NUMBERS for x in row):          # the slow check names the first bad one
            for j, x in enumerate(row):
                _number(x, f"{where}: {key}[{i}][{j}]")
    arr = np.array(value, dtype=np.float64)
    if not np.isfinite(arr).all():
        i, j = (int(k) for k in np.argwhere(~np.isfinite(arr))[0])
        _number(value[i][j], f"{where}: {key}[{i}][{j}]")
    return arr


#: Types whose values need no per-element check beyond finiteness (bool and _YamlBool are not among them).
_PLAIN_NUMBERS = frozenset({Number, _Int, float, int})


def _describe(v) -> str:
    if v is None:
        return "nothing (null)"
    if isinstance(v, _YamlBool):
        return f"the boolean {v}"
    if isinstance(v, str):
        return f"the text {v!r}"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)}"
    if _is_number(v):
        return f"the number {_short(text_of(v))}"
    return type(v).__name__


def _labels(value, key: str, n: int, what: str, where: str) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a list of {n} labels ({what}), found {_describe(value)}")
    out = []
    for i, t in enumerate(value):
        if t is None or isinstance(t, (dict, list, tuple)):
            raise WorkedExampleError(f"{where}: {key}[{i}]: expected a label (text), found {_describe(t)}")
        out.append(text_of(t) if _is_number(t) and not isinstance(t, bool) else str(t))
    if len(out) != n:
        raise WorkedExampleError(f"{where}: {key}: expected {n} labels ({what}), found {len(out)}")
    return out


def _flag(x, where: str) -> bool:
    if isinstance(x, _YamlBool):
        return x.value
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if _is_number(x) and float(x) in (0.0, 1.0):
        return bool(float(x))
    raise WorkedExampleError(f"{where}: expected true or false (true = may attend), found {_describe(x)}")


def _mask(value, L: int, S: int, where: str):
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.dtype == np.bool_:
        if value.shape != (L, S):
            raise WorkedExampleError(f"{where}: mask: expected a {L}×{S} boolean matrix (queries × keys), "
                                     f"found shape {value.shape}")
        return value.copy()
    if isinstance(value, str) and not isinstance(value, _YamlBool):
        v = value.strip().lower()
        if v == "causal":
            return "causal"
        if v in ("none", ""):
            return None
        raise WorkedExampleError(f"{where}: mask: expected 'causal', 'none' or a boolean matrix, found {value!r}")
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise WorkedExampleError(f"{where}: mask: expected 'causal' or a {L}×{S} boolean matrix, found "
                                 f"{_describe(value)}")
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, (list, tuple)):
            raise WorkedExampleError(f"{where}: mask row {i}: expected a list of {S} true/false, found {_describe(row)}")
        if len(row) != S:
            raise WorkedExampleError(f"{where}: mask row {i}: expected {S} entries (one per key), found {len(row)}")
        rows.append([_flag(x, f"{where}: mask[{i}][{j}]") for j, x in enumerate(row)])
    if len(rows) != L:
        raise WorkedExampleError(f"{where}: mask: expected {L} rows (one per query), found {len(rows)}")
    return np.array(rows, dtype=bool)


def _scalar(value, key: str, where: str, *, positive: bool = True):
    _number(value, f"{where}: {key}")
    if positive and float(value) <= 0:
        raise WorkedExampleError(f"{where}: {key}: expected a positive number, found {text_of(value)}")
    return value


def _row_index(key, labels: list[str], given: bool, n: int, where: str) -> int:
    """A claim's row key: a label of the rows, else a 0-based index."""
    if isinstance(key, _YamlBool):
        key_text = str(key)
    elif _is_number(key):
        key_text = text_of(key)
    else:
        key_text = str(key)
    if given:
        hits = [i for i, t in enumerate(labels) if t == key_text]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise WorkedExampleError(f"{where}: row {key_text!r}: the label appears {len(hits)} times "
                                     f"(rows {hits}); use the 0-based row index instead")
    idx = None
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        idx = int(key)
    elif isinstance(key, str) and re.fullmatch(r"\d+", key_text):
        idx = int(key_text)
    if idx is None:
        known = labels if given else []
        hint = f"one of {known} or a row index 0..{n - 1}" if known else f"a row index 0..{n - 1} (no labels given)"
        raise WorkedExampleError(f"{where}: row {key_text!r}: no such label; expected {hint}")
    if not 0 <= idx < n:
        raise WorkedExampleError(f"{where}: row {idx}: expected a row index 0..{n - 1}")
    return idx


def _claim_row(values, width: int, where: str) -> list:
    if _is_number(values) or isinstance(values, _YamlBool):
        if width != 1:
            raise WorkedExampleError(f"{where}: expected a list of {width} numbers, found a single number")
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise WorkedExampleError(f"{where}: expected a list of {width} numbers, found {_describe(values)}")
    if len(values) != width:
        raise WorkedExampleError(f"{where}: expected {width} numbers, found {len(values)}")
    out = []
    for j, x in enumerate(values):
        if x is None:
            out.append(None)                                    # null: not claimed
            continue
        _number(x, f"{where}[{j}]")
        out.append(x if isinstance(x, Number) else Number(float(x), text_of(x)))
    return out


def _claims(value, w: Worked, shapes: dict[str, tuple[int, int]], where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WorkedExampleError(f"{where}: claims: expected a mapping of step names ({', '.join(CLAIM_NAMES)}) "
                                 f"to rows, found {_describe(value)}")
    out: dict[str, dict[int, list]] = {}
    for name, rows in value.items():
        name = str(name)
        if name not in CLAIM_NAMES:
            raise WorkedExampleError(f"{where}: claims: unknown name {name!r}; expected one of "
                                     f"{', '.join(CLAIM_NAMES)}")
        if name not in shapes:
            raise WorkedExampleError(f"{where}: claims.{name}: this example does not compute {name} "
                                     f"({_why_missing(name, w)})")
        L, C = shapes[name]
        key_side = name in KEY_SIDE
        labels = w.key_labels if key_side else list(w.tokens)
        given = (w.kv_tokens_given if (key_side and w.kv_tokens is not None) else w.tokens_given)
        at = f"{where}: claims.{name}"
        parsed: dict[int, list] = {}
        if isinstance(rows, dict):
            for key, vals in rows.items():
                i = _row_index(key, labels, given, L, at)
                label = labels[i]
                parsed[i] = _claim_row(vals, C, f"{at}[{label if given else i}]")
        elif isinstance(rows, (list, tuple)) and rows and all(isinstance(r, (list, tuple)) for r in rows):
            if len(rows) != L:
                raise WorkedExampleError(f"{at}: expected {L} rows (the whole matrix), found {len(rows)}; give "
                                         "a subset as a mapping {label or row index: [...]}")
            for i, vals in enumerate(rows):
                parsed[i] = _claim_row(vals, C, f"{at}[{i}]")
        elif isinstance(rows, (list, tuple)) and rows and L == 1:
            parsed[0] = _claim_row(rows, C, f"{at}[0]")
        elif isinstance(rows, (list, tuple)) and rows and C == 1:
            if len(rows) != L:
                raise WorkedExampleError(f"{at}: expected {L} numbers (one column), found {len(rows)}")
            for i, x in enumerate(rows):
                parsed[i] = _claim_row([x], 1, f"{at}[{i}]")
        elif _is_number(rows) and L == 1 and C == 1:
            parsed[0] = _claim_row([rows], 1, f"{at}")
        else:
            raise WorkedExampleError(f"{at}: expected a {L}×{C} matrix or a mapping {{label or row index: "
                                     f"[{C} numbers]}}, found {_describe(rows)}")
        out[name] = parsed
    return out


def _why_missing(name: str, w: Worked) -> str:
    if name in ("Q_rot", "K_rot") and w.rope is None:
        return "it has no rope:"
    if name == "biased" and w.alibi is None:
        return "it has no alibi:"
    if name == "capped" and w.softcap is None:
        return "it has no softcap:"
    if w.heads > 1:
        return f"per-head {name} claims are not supported with heads > 1; claim Q, K or V"
    if name in ("Q", "K") and w.start == "scores":
        return "it starts from scores"
    if name == "V" or name == "output":
        return "it gives no V"
    return "not part of this example"


def from_dict(doc, *, name: str | None = None, where: str | None = None) -> Worked:
    """Validate a parsed worked example (a mapping as in the file format) into a :class:`Worked`."""
    where = where or name or "worked example"
    if not isinstance(doc, dict):
        raise WorkedExampleError(f"{where}: expected a mapping of keys (title, tokens, X, W_Q, ..., claims), "
                                 f"found {_describe(doc)}")
    doc = {str(k): v for k, v in doc.items()}
    unknown = [k for k in doc if k not in _KNOWN_KEYS]
    if unknown:
        raise WorkedExampleError(f"{where}: unknown key {unknown[0]!r}; expected some of {', '.join(_KNOWN_KEYS)}")
    w = Worked(name=name)
    for key in ("title", "description"):
        v = doc.get(key)
        if v is not None and (isinstance(v, (dict, list, tuple))):
            raise WorkedExampleError(f"{where}: {key}: expected text, found {_describe(v)}")
        setattr(w, key, None if v is None else str(text_of(v) if _is_number(v) else v))

    for key in ("X", "X_kv", "W_Q", "W_K", "W_V", "W_O", "Q", "K", "V", "scores"):
        if key in doc and doc[key] is None:
            raise WorkedExampleError(f"{where}: {key}: expected a matrix (a list of rows), found nothing (null)")
    has_x = doc.get("X") is not None
    has_qk = doc.get("Q") is not None or doc.get("K") is not None
    has_scores = doc.get("scores") is not None
    starts = [s for s, f in (("X", has_x), ("Q/K", has_qk), ("scores", has_scores)) if f]
    if not starts:
        raise WorkedExampleError(f"{where}: no starting point; expected X (with W_Q, W_K, W_V), or Q and K, or "
                                 "scores")
    if len(starts) > 1:
        raise WorkedExampleError(f"{where}: expected one starting point, found {' and '.join(starts)} (claim later "
                                 "steps under claims:)")
    shapes: dict[str, tuple[int, int]] = {}
    if has_x:
        w.X = _matrix(doc["X"], "X", where)
        if doc.get("X_kv") is not None:
            w.X_kv = _matrix(doc["X_kv"], "X_kv", where)
        D = w.X.shape[1]
        Dkv = D if w.X_kv is None else w.X_kv.shape[1]
        for key, rows in (("W_Q", D), ("W_K", Dkv), ("W_V", Dkv)):
            if doc.get(key) is None:
                raise WorkedExampleError(f"{where}: {key}: missing; X needs W_Q, W_K and W_V")
            m = _matrix(doc[key], key, where)
            if m.shape[0] != rows:
                src = "X" if key == "W_Q" or w.X_kv is None else "X_kv"
                raise WorkedExampleError(f"{where}: {key}: expected {rows} rows (the width of {src}), found "
                                         f"{m.shape[0]}")
            setattr(w, key, m)
        if w.W_K.shape[1] != w.W_Q.shape[1]:
            raise WorkedExampleError(f"{where}: W_K: expected {w.W_Q.shape[1]} columns (as W_Q: queries and keys "
                                     f"share a width), found {w.W_K.shape[1]}")
        for key in ("V",):
            if doc.get(key) is not None:
                raise WorkedExampleError(f"{where}: V: not allowed with X (V = X·W_V); claim it under claims:")
        L, S = w.X.shape[0], (w.X if w.X_kv is None else w.X_kv).shape[0]
        E, Ev = w.W_Q.shape[1], w.W_V.shape[1]
    elif has_qk:
        for key in ("Q", "K"):
            if doc.get(key) is None:
                raise WorkedExampleError(f"{where}: {key}: missing; a file that starts from Q and K needs both")
            setattr(w, key, _matrix(doc[key], key, where))
        if w.K.shape[1] != w.Q.shape[1]:
            raise WorkedExampleError(f"{where}: K: expected {w.Q.shape[1]} columns (the width of Q), found "
                                     f"{w.K.shape[1]}")
        L, S, E = w.Q.shape[0], w.K.shape[0], w.Q.shape[1]
        if doc.get("V") is not None:
            w.V = _matrix(doc["V"], "V", where, allow_vector="column")
            if w.V.shape[0] != S:
                raise WorkedExampleError(f"{where}: V: expected {S} rows (one per key), found {w.V.shape[0]}")
        Ev = None if w.V is None else w.V.shape[1]
    else:
        w.scores = _matrix(doc["scores"], "scores", where, allow_vector="row")
        L, S = w.scores.shape
        E = None
        if doc.get("V") is not None:
            w.V = _matrix(doc["V"], "V", where, allow_vector="column")
            if w.V.shape[0] != S:
                raise WorkedExampleError(f"{where}: V: expected {S} rows (one per key, the columns of scores), "
                                         f"found {w.V.shape[0]}")
        Ev = None if w.V is None else w.V.shape[1]
    for key in ("X_kv", "W_Q", "W_K", "W_V"):
        if not has_x and doc.get(key) is not None:
            raise WorkedExampleError(f"{where}: {key}: only used with X; this file starts from {starts[0]}")

    if doc.get("heads") is not None:
        h = doc["heads"]
        if not isinstance(h, numbers.Integral) or isinstance(h, bool) or isinstance(h, _YamlBool) or h < 1:
            raise WorkedExampleError(f"{where}: heads: expected a positive integer, found {_describe(h)}")
        w.heads = int(h)
    if doc.get("W_O") is not None:
        w.W_O = _matrix(doc["W_O"], "W_O", where)
    if w.heads > 1 or w.W_O is not None:
        if not has_x:
            raise WorkedExampleError(f"{where}: heads: several heads and W_O need X with W_Q, W_K, W_V")
        err = _heads_problem(w.W_Q, w.W_K, w.W_V, w.W_O, w.heads)
        if err:
            raise WorkedExampleError(f"{where}: {err}")

    if doc.get("d_k") is not None:
        w.d_k = _scalar(doc["d_k"], "d_k", where)
        if w.heads > 1 and float(w.d_k) != w.W_Q.shape[1] // w.heads:
            raise WorkedExampleError(f"{where}: d_k: with {w.heads} heads it is the head width "
                                     f"{w.W_Q.shape[1] // w.heads}, found {text_of(w.d_k)}")
    elif not has_x and not has_qk:
        raise WorkedExampleError(f"{where}: d_k: missing; a file that starts from scores needs d_k (the d in √d_k)")
    if doc.get("tolerance") is not None:
        w.tolerance = float(_scalar(doc["tolerance"], "tolerance", where, positive=False))
        if w.tolerance < 0:
            raise WorkedExampleError(f"{where}: tolerance: expected a number ≥ 0, found {w.tolerance}")

    # labels
    if doc.get("tokens") is not None:
        w.tokens = _labels(doc["tokens"], "tokens", L, "one per query row", where)
        w.tokens_given = True
    else:
        w.tokens = [f"#{i}" for i in range(L)]
    cross = (has_x and w.X_kv is not None) or (not has_x and S != L)
    if doc.get("kv_tokens") is not None:
        w.kv_tokens = _labels(doc["kv_tokens"], "kv_tokens", S, "one per key/value row", where)
        w.kv_tokens_given = True
    elif cross:
        w.kv_tokens = [f"#{j}" for j in range(S)]

    w.mask = _mask(doc.get("mask"), L, S, where)
    _variants(doc, w, L, S, E, where)
    # shapes of what can be claimed
    if has_x:
        if w.heads == 1:
            shapes.update(Q=(L, E), K=(S, E), V=(S, Ev), scores=(L, S), scaled=(L, S), weights=(L, S),
                          output=(L, Ev))
        else:
            shapes.update(Q=(L, E), K=(S, E), V=(S, Ev))
    elif has_qk:
        shapes.update(Q=(L, E), K=(S, E), scores=(L, S), scaled=(L, S), weights=(L, S))
        if w.V is not None:
            shapes.update(V=(S, Ev), output=(L, Ev))
    else:
        shapes.update(scores=(L, S), scaled=(L, S), weights=(L, S))
        if w.V is not None:
            shapes.update(V=(S, Ev), output=(L, Ev))
    if w.heads == 1:
        if w.rope is not None:
            shapes.update(Q_rot=(L, E), K_rot=(S, E))
        if w.alibi is not None:
            shapes.update(biased=(L, S))
        if w.softcap is not None:
            shapes.update(capped=(L, S))
    w.claims = _claims(doc.get("claims"), w, shapes, where)
    return w


def _nonneg_int(value, key: str, where: str, *, minimum: int = 1) -> int:
    if isinstance(value, (_YamlBool, bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer ≥ {minimum}"
        raise WorkedExampleError(f"{where}: {key}: expected {what}, found {_describe(value)}")
    return int(value)


def _int_list(value, key: str, n: int, what: str, where: str, *, minimum: int = 0) -> np.ndarray:
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a list of {n} integers ({what}), found "
                                 f"{_describe(value)}")
    out = [_nonneg_int(x, f"{key}[{i}]", where, minimum=minimum) for i, x in enumerate(value)]
    if len(out) != n:
        raise WorkedExampleError(f"{where}: {key}: expected {n} integers ({what}), found {len(out)}")
    return np.asarray(out, dtype=np.int64)


def _number_list(value, key: str, n: int, what: str, where: str) -> np.ndarray:
    if _is_number(value) and n == 1:
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise WorkedExampleError(f"{where}: {key}: expected a list of {n} numbers ({what}), found {_describe(value)}")
    for i, x in enumerate(value):
        _number(x, f"{where}: {key}[{i}]")
    if len(value) != n:
        raise WorkedExampleError(f"{where}: {key}: expected {n} numbers ({what}), found {len(value)}")
    return np.asarray([float(x) for x in value], dtype=np.float64)


def _variants(doc: dict, w: Worked, L: int, S: int, E: int | None, where: str) -> None:
    """Validate the variant keys (rope, alibi, softcap, window, prefix, documents, sinks, sink_logits) into
    ``w``; each error names the key, expected vs found."""
    H = w.heads
    if doc.get("rope") is not None:
        r = doc["rope"]
        if isinstance(r, _YamlBool) or isinstance(r, bool):
            r = {} if (r.value if isinstance(r, _YamlBool) else r) else None
        if r is not None:
            if not isinstance(r, dict):
                raise WorkedExampleError(f"{where}: rope: expected a mapping {{theta: 10000, style: neox}} (or "
                                         f"true), found {_describe(r)}")
            r = {str(k): v for k, v in r.items()}
            bad = [k for k in r if k not in _ROPE_KEYS]
            if bad:
                raise WorkedExampleError(f"{where}: rope: unknown key {bad[0]!r}; expected some of "
                                         f"{', '.join(_ROPE_KEYS)}")
            if w.start == "scores":
                raise WorkedExampleError(f"{where}: rope: RoPE rotates Q and K; this file starts from scores "
                                         "(give X with W_Q, W_K, W_V, or Q and K)")
            width = E // H
            if width % 2:
                raise WorkedExampleError(f"{where}: rope: RoPE rotates pairs of coordinates; expected an even "
                                         f"{'head ' if H > 1 else ''}width of Q and K, found {width}")
            theta = r.get("theta", 10000.0)
            theta = float(_scalar(theta, "rope.theta", where)) if theta is not None else 10000.0
            style = r.get("style", "neox")
            if not isinstance(style, str) or isinstance(style, _YamlBool) or style not in _ROPE_STYLES:
                raise WorkedExampleError(f"{where}: rope.style: expected one of {', '.join(_ROPE_STYLES)}, found "
                                         f"{_describe(style)}")
            w.rope = {"theta": theta, "style": str(style)}
            if r.get("positions") is not None:
                w.positions = _int_list(r["positions"], "rope.positions", L, "one per query row", where)
            if r.get("kv_positions") is not None:
                if not w.is_cross:
                    raise WorkedExampleError(f"{where}: rope.kv_positions: only with cross-attention (in "
                                             "self-attention the keys are at the queries' positions)")
                w.kv_positions = _int_list(r["kv_positions"], "rope.kv_positions", S, "one per key row", where)
    if doc.get("alibi") is not None:
        a = doc["alibi"]
        if isinstance(a, (_YamlBool, bool)):
            w.alibi = True if (a.value if isinstance(a, _YamlBool) else a) else None
        elif isinstance(a, (list, tuple)) or (_is_number(a) and H == 1):
            w.alibi = _number_list(a, "alibi", H, "one slope per head", where)
        else:
            raise WorkedExampleError(f"{where}: alibi: expected true (slopes from the head count) or a list of "
                                     f"{H} slopes (one per head), found {_describe(a)}")
    if doc.get("softcap") is not None:
        w.softcap = float(_scalar(doc["softcap"], "softcap", where))
    if doc.get("window") is not None:
        w.window = _nonneg_int(doc["window"], "window", where)
    if doc.get("prefix") is not None:
        w.prefix = _nonneg_int(doc["prefix"], "prefix", where)
    if doc.get("sinks") is not None:
        w.sinks = _nonneg_int(doc["sinks"], "sinks", where)
    if doc.get("documents") is not None:
        d = doc["documents"]
        if L != S or w.is_cross:
            raise WorkedExampleError(f"{where}: documents: packed documents need self-attention (queries and "
                                     f"keys at the same positions); found {L} queries and {S} keys")
        if isinstance(d, dict):
            d = {str(k): v for k, v in d.items()}
            if set(d) == {"ids"}:
                w.documents = _int_list(d["ids"], "documents.ids", S, "the document of each position", where)
            elif set(d) == {"lengths"}:
                w.documents = _lengths_to_ids(d["lengths"], "documents.lengths", S, where)
            else:
                raise WorkedExampleError(f"{where}: documents: expected a list of lengths, {{lengths: [...]}} or "
                                         f"{{ids: [...]}}, found the keys {sorted(d)}")
        else:
            w.documents = _lengths_to_ids(d, "documents", S, where)
    if doc.get("sink_logits") is not None:
        w.sink_logits = _number_list(doc["sink_logits"], "sink_logits", H, "one per head", where)


def _lengths_to_ids(value, key: str, S: int, where: str) -> np.ndarray:
    if not isinstance(value, (list, tuple)) or not value:
        raise WorkedExampleError(f"{where}: {key}: expected a list of document lengths summing to {S} (the "
                                 f"sequence), found {_describe(value)}")
    lengths = [_nonneg_int(x, f"{key}[{i}]", where) for i, x in enumerate(value)]
    if sum(lengths) != S:
        raise WorkedExampleError(f"{where}: {key}: expected lengths summing to {S} (the sequence), found "
                                 f"{' + '.join(map(str, lengths))} = {sum(lengths)}")
    return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


def _heads_problem(W_Q, W_K, W_V, W_O, heads: int) -> str | None:
    """Why these projections cannot be split into ``heads`` heads (None when they can)."""
    F, Fv = W_Q.shape[1], W_V.shape[1]
    if F % heads:
        return (f"heads: {heads} heads need a projection width divisible by {heads}; W_Q has {F} columns "
                f"(head width = columns / heads)")
    if Fv % heads:
        return f"heads: {heads} heads need W_V's width divisible by {heads}; W_V has {Fv} columns"
    if W_O is not None and W_O.shape[0] != Fv:
        return (f"W_O: expected {Fv} rows (the width of the concatenated heads), found {W_O.shape[0]}×"
                f"{W_O.shape[1]}")
    return None


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
TITLE_KEYS = {"alibi": "explain.example_alibi", "causal": "explain.example_causal", "cross": "explain.example_cross",
              "document": "explain.example_document", "padding": "explain.example_padding",
              "rope": "explain.example_rope", "seed000": "explain.example_seed000",
              "seed002": "explain.example_seed002", "seed003": "explain.example_seed003",
              "sinks": "explain.example_sinks", "sliding_window": "explain.example_sliding_window",
              "softcap": "explain.example_softcap", "two_head": "explain.example_two_head"}


def titles(worked: Worked) -> dict[str, str] | None:
    """A built-in example's title in each language (``{"en": …, "zh": …}``, :mod:`qkv.locales`) while its title
    is the built-in's; None for any other title (a file's, or one set by the user), which stays as written."""
    from qkv import locales

    key = TITLE_KEYS.get(worked.name) if isinstance(worked.name, str) else None
    if key is None or worked.title != locales.t(key, "en"):
        return None
    return {lang: locales.t(key, lang) for lang in locales.langs()}


# ----------------------------------------------------------------------------------------------- running
def _resolve_mask(worked: Worked, mask):
    L, S = worked.n_queries, worked.n_keys
    if mask is None:
        return worked.mask
    if isinstance(mask, str):
        m = mask.strip().lower()
        if m == "none":
            return None
        if m == "causal":
            return "causal"
        raise ValueError(f"mask: expected 'causal', 'none', a boolean array or None, got {mask!r}")
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise TypeError(f"mask: expected a boolean array (True = may attend), got dtype {arr.dtype}")
    try:
        np.broadcast_shapes(arr.shape, (L, S))
    except ValueError:
        raise ValueError(f"mask: expected a boolean array broadcastable to ({L}, {S}), got shape {arr.shape}") from None
    if arr.ndim > 2 and worked.heads == 1:
        raise ValueError(f"mask: expected a boolean array of shape ({L}, {S}), got shape {arr.shape}")
    return np.broadcast_to(arr, (L, S)).copy() if arr.ndim <= 2 else arr


def _plain_d_k(d_k):
    """d_k as the formula shows it: an int when it is one."""
    if d_k is None:
        return None
    d = float(d_k)
    return int(d) if d.is_integer() else d


def _mask_mod(worked: Worked, m, L: int, S: int):
    """The example's mask as a :class:`qkv.mods.MaskMod` when it uses window, prefix, documents or sinks
    (``mask:`` and-ed with them; ``sinks`` or-ed with the result, or with causal when nothing else masks);
    None otherwise."""
    from .. import mods

    parts = []
    if isinstance(m, str) and m == "causal":
        parts.append(mods.causal())
    elif m is not None:
        given = np.asarray(m, dtype=bool)

        def file_mask(b, h, q_idx, kv_idx):
            return given[q_idx, kv_idx]
        parts.append(mods.MaskMod(file_mask, name="matrix"))
    if worked.window is not None:
        parts.append(mods.sliding_window(worked.window))
    if worked.prefix is not None:
        parts.append(mods.prefix_lm(worked.prefix))
    if worked.documents is not None:
        parts.append(mods.document(worked.documents))
    mod = None if not parts else parts[0] if len(parts) == 1 else mods.and_masks(*parts)
    if worked.sinks is not None:
        mod = mods.or_masks(mods.sinks(worked.sinks), mod if mod is not None else mods.causal())
    return mod


def _options(worked: Worked, m, L: int, S: int, h: int, q_range: tuple[int, int] | None = None) -> dict:
    """The keyword arguments of :func:`qkv.pipeline.attend` for this example: its mask (and where it came
    from), its score mods (ALiBi, soft-capping), sink logits and RoPE. ``m`` is the ``mask:`` key (or what
    ``run(mask=...)`` put in its place); window, prefix, documents and sinks combine with it.

    ``q_range=(r0, r1)``: for the query rows r0 … r1−1 only (:func:`run_rows`): the mask's rows r0 … r1−1, and
    score mods that see the true query index (``q_idx + r0``)."""
    from .. import masks as _masks
    from .. import mods, pipeline
    from ..positions import RoPE

    opts: dict = {}
    r0, r1 = (0, L) if q_range is None else q_range
    mod = _mask_mod(worked, m, L, S) if worked.has_mask_mods else None
    if mod is not None:
        lead = (1, h) if h > 1 or worked.sink_logits is not None else ()
        b, hh, q_idx, kv_idx = pipeline.indices(lead, r1 - r0, S, q_offset=r0)
        dense = mods.call_mask_mod(mod, b, hh, q_idx, kv_idx)                      # bool, broadcastable
        opts.update(mask=np.array(np.broadcast_to(dense, np.broadcast_shapes(dense.shape, (r1 - r0, S)))),
                    mask_source=mod)
    elif isinstance(m, str) and m == "causal":
        if q_range is None:
            opts.update(mask=_masks.causal(L, S), mask_source="causal")
        else:                                       # rows r0 … r1−1 of masks.causal(L, S) (top-left: j ≤ i)
            opts.update(mask=np.arange(S)[None, :] <= np.arange(r0, r1)[:, None], mask_source="causal")
    elif m is not None:
        opts.update(mask=m if q_range is None else np.asarray(m)[..., r0:r1, :], mask_source="attn_mask")
    score_mods = []
    if worked.alibi is not None:
        if worked.alibi is True:
            slopes = mods.alibi_slopes(h)
        else:
            slopes = np.asarray(worked.alibi, dtype=np.float64)
            if slopes.size != h:
                raise ValueError(f"heads: the example's alibi gives {slopes.size} slope(s), one per head; "
                                 f"expected {h} for {h} heads")
        score_mods.append(mods.alibi(slopes))
    if worked.softcap is not None:
        score_mods.append(mods.softcap(worked.softcap))
    if score_mods:
        opts["score_mod"] = score_mods[0] if len(score_mods) == 1 else mods.compose(*score_mods)
        if r0:
            opts["score_mod"] = _shifted(opts["score_mod"], r0)
    if worked.sink_logits is not None:
        if worked.sink_logits.size != h:
            raise ValueError(f"heads: the example's sink_logits give {worked.sink_logits.size} logit(s), one "
                             f"per head; expected {h} for {h} heads")
        opts["sink_logits"] = worked.sink_logits
    if worked.rope is not None:
        opts["rope"] = RoPE(theta=worked.rope["theta"], style=worked.rope["style"])
        q_pos = worked.positions if worked.positions is not None else np.arange(L, dtype=np.int64)
        if worked.kv_positions is not None:
            k_pos = worked.kv_positions
        elif not worked.is_cross:
            k_pos = q_pos
        else:
            k_pos = np.arange(S, dtype=np.int64)
        opts.update(q_positions=q_pos, k_positions=k_pos)
    return opts


def _shifted(mod, r0: int):
    """``mod`` seeing query indices shifted by ``r0`` (a block of rows r0 … computed on its own)."""
    from .. import mods

    def fn(score, b, h, q_idx, kv_idx):
        return mod(score, b, h, q_idx + r0, kv_idx)
    return mods.ScoreMod(fn, name=mod.name, params=mod.params, records=mod.records, step_names=mod.step_names)


def run(worked: Worked, *, heads: int | None = None, mask=None, trace=None):
    """Run a worked example through qkv's one orchestration of the stages and return the :class:`qkv.Trace`.

    Every example goes through :func:`qkv.pipeline.attend` (the reference backend's own function): X examples
    project Q, K, V with :func:`qkv.stages.project` first; several heads split them (``split_heads``), attend
    per head and concatenate (``merge_heads``, then ``· W_O``) — with square projections through
    :class:`qkv.MultiHeadAttention` itself. Q/K examples and scores examples start at their step. The trace
    is checked afterwards: a step that overflowed (±inf or NaN where a number belongs) raises
    :class:`WorkedExampleError` naming it.

    Args:
        worked: the example.
        heads: override the number of heads (X examples whose projection widths divide by it).
        mask: override the file's ``mask:`` key: ``"causal"``, ``"none"``, or a boolean array (True = may
            attend); window, prefix, documents and sinks still combine with it.
        trace: a :class:`qkv.Trace` to record into (a new one by default). A trace with a ``substitute``
            (the checker's) continues with what it returns at every step.
    """
    from ..tracing import Trace

    if not isinstance(worked, Worked):
        raise TypeError(f"worked: expected a qkv.explain.examples.Worked, got {type(worked).__name__}")
    if trace is None:
        trace = Trace()
    elif not isinstance(trace, Trace):
        raise TypeError(f"trace: expected a qkv.Trace or None, got {type(trace).__name__}")
    h = worked.heads if heads is None else heads
    if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
        raise ValueError(f"heads: expected a positive integer, got {h!r}")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):    # an overflow is reported below
        _forward(worked, int(h), _resolve_mask(worked, mask), trace)
    if trace.substitute is None:
        _check_finite(trace, worked)
    return trace


def _forward(worked: Worked, h: int, m, trace) -> None:
    from .. import pipeline, stages
    from ..mha import MultiHeadAttention
    from ..tracing import trace as tracing

    L, S = worked.n_queries, worked.n_keys
    opts = _options(worked, m, L, S, h)
    d_k = _plain_d_k(worked.d_k)
    start = worked.start
    if h > 1:
        if start != "X":
            raise ValueError(f"heads: several heads need an example that starts from X (this one starts from "
                             f"{'Q and K' if start == 'QK' else 'scores'})")
        problem = _heads_problem(worked.W_Q, worked.W_K, worked.W_V, worked.W_O, h)
        if problem:
            raise ValueError(problem)
        D, F = worked.X.shape[1], worked.W_Q.shape[1]
        if d_k is not None and float(d_k) != F // h:
            raise ValueError(f"heads: d_k = {text_of(worked.d_k)} but {h} heads have width {F // h}")
        x_kv = worked.X_kv
        plain = set(opts) <= {"mask", "mask_source"}
        square = (worked.W_Q.shape == (D, D) and worked.W_K.shape[1] == D and worked.W_V.shape[1] == D
                  and (worked.W_O is None or worked.W_O.shape == (D, D)))
        if square and plain:                       # the real MultiHeadAttention (it runs pipeline.attend)
            mha = MultiHeadAttention(D, h, bias=False, kdim=None if x_kv is None else x_kv.shape[1],
                                     vdim=None if x_kv is None else x_kv.shape[1], dtype=np.float64)
            W_O = worked.W_O if worked.W_O is not None else np.eye(D)
            mha.load(W_Q=worked.W_Q, W_K=worked.W_K, W_V=worked.W_V, W_O=W_O)
            causal = isinstance(m, str)
            mha.forward(worked.X, x_kv, x_kv, attn_mask=None if causal else m, is_causal=causal, trace=trace)
            return
        # MultiHeadAttention's stages in its order (other widths, e.g. seed 003's 4×3 split into 3 heads of
        # 1, or the variants): project, split_heads, pipeline.attend on every head, merge_heads, [· W_O]
        with tracing(trace):
            x = stages.observe_input("X", worked.X[None])                              # (1, L, D)
            kv = x if x_kv is None else stages.observe_input("X_kv", x_kv[None])       # (1, S, D_kv)
            kv_name = "X" if x_kv is None else "X_kv"
            q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")
            k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)
            v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)
            q, k, v = (stages.split_heads(a, h, name=n) for a, n in ((q, "Q"), (k, "K"), (v, "V")))
            E = q.shape[-1]
            out, _, _ = pipeline.attend(q, k, v, scale=1.0 / math.sqrt(E if d_k is None else d_k), d_k=d_k,
                                        **opts)                                         # (1, H, L, Ev)
            out = stages.merge_heads(out)                                               # (1, L, H·Ev)
            if worked.W_O is not None:
                stages.project(out, worked.W_O, name="final_output", weight_name="W_O", input_name="concat")
        return
    with tracing(trace):
        if start == "X":
            x = stages.observe_input("X", worked.X)                                     # (L, D)
            kv = x if worked.X_kv is None else stages.observe_input("X_kv", worked.X_kv)  # (S, D_kv)
            kv_name = "X" if worked.X_kv is None else "X_kv"
            q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")         # (L, E)
            k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)    # (S, E)
            v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)    # (S, Ev)
            scores = None
        elif start == "QK":
            q = stages.observe_input("Q", worked.Q)
            k = stages.observe_input("K", worked.K)
            v = None if worked.V is None else stages.observe_input("V", worked.V)
            scores = None
        else:
            q = k = None
            scores = stages.observe_input("scores", worked.scores, "scores (given)")
            v = None if worked.V is None else stages.observe_input("V", worked.V)
        width = q.shape[-1] if q is not None else None
        dd = d_k if d_k is not None else width
        if "sink_logits" in opts:               # one sink logit per head: the attention arrays get a head axis
            q, k, v, scores = (None if a is None else a[None] for a in (q, k, v, scores))
        out, _, _ = pipeline.attend(q, k, v, scale=1.0 / math.sqrt(dd), d_k=dd, scores=scores, **opts)
        if worked.W_O is not None:              # one head's output is its concat: · W_O as with several
            stages.project(out, worked.W_O, name="final_output", weight_name="W_O", input_name="output")


# ----------------------------------------------------------------------------------------------- large inputs
#: Above this many attention weights (heads × L × S) ``qkv explain`` runs a worked example with
#: :func:`run_rows`: about 8 MB per (L, S) step in float64, where a full trace holds 5 or 6 of them.
LARGE_CELLS = 1 << 20
#: The attention weights one block of rows computes at a time in :func:`run_rows` (16 MB per float64 array).
BLOCK_CELLS = 1 << 21


def is_large(worked: Worked, heads: int | None = None) -> bool:
    """True when the example's attention (heads × L × S weights) is too large to keep whole in a trace."""
    h = worked.heads if heads is None else int(heads)
    return h * worked.n_queries * worked.n_keys > LARGE_CELLS


def run_rows(worked: Worked, rows, *, heads: int | None = None, mask=None, block_cells: int | None = None,
             substitute=None):
    """Run a worked example as :func:`run` does, keeping the (L, S) steps only at the query ``rows``.

    The same stages compute the same numbers: the projections, the head split, RoPE, the concat and W_O on
    every row, recorded whole; the attention part (scores → scaled → [biased, capped] → masked → weights →
    output) in blocks of query rows (``block_cells`` weights at a time; every query row's attention needs only
    its own q and all of K and V), each block recorded into a trace of its own that is read and dropped. Those
    steps keep their array, and their row-indexed operands, at ``rows`` only, with ``params``: ``rows`` (the
    true row indices), ``full_shape``, ``stats`` (per (batch, head) slice: count, min, max and mean of the
    finite values over every row) and ``row_operands``; :mod:`qkv.explain.render` writes such a trace as it
    writes a whole one. The output step holds the kept rows; the concat after it is of every row.

    Memory is O(rows × S + block) instead of O(L × S) for each of the 5–6 steps a trace keeps: a 10,000-token
    example needs about 200 MB, not 13 GB. Float64 throughout (the numbers are the ones :func:`run` gives).

    ``substitute(name, array, row0)``, when given, is the checker's: every step's result passes through it as
    through a :class:`qkv.Trace`'s ``substitute`` (and the steps are not checked for overflow, as in
    :func:`run`); ``row0`` is the true index of the array's first query row (0 for the steps kept whole).
    """
    from .. import pipeline, stages
    from ..positions import RoPE
    from ..stages import Names
    from ..tracing import Step, Trace
    from ..tracing import trace as tracing

    if not isinstance(worked, Worked):
        raise TypeError(f"worked: expected a qkv.explain.examples.Worked, got {type(worked).__name__}")
    h = worked.heads if heads is None else heads
    if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
        raise ValueError(f"heads: expected a positive integer, got {h!r}")
    h = int(h)
    L, S = worked.n_queries, worked.n_keys
    keep = sorted({int(r) for r in rows})
    if not keep or keep[0] < 0 or keep[-1] >= L:
        raise ValueError(f"rows: expected row indices 0..{L - 1}, got {list(rows)!r}")
    m = _resolve_mask(worked, mask)
    d_k = _plain_d_k(worked.d_k)
    start = worked.start
    main = Trace(substitute=None if substitute is None else functools.partial(_at_row, substitute, 0))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), tracing(main):
        q_pos = k_pos = None
        if worked.rope is not None:
            q_pos = worked.positions if worked.positions is not None else np.arange(L, dtype=np.int64)
            k_pos = (worked.kv_positions if worked.kv_positions is not None
                     else q_pos if not worked.is_cross else np.arange(S, dtype=np.int64))
        scores = None
        if h > 1:
            if start != "X":
                raise ValueError(f"heads: several heads need an example that starts from X (this one starts from "
                                 f"{'Q and K' if start == 'QK' else 'scores'})")
            problem = _heads_problem(worked.W_Q, worked.W_K, worked.W_V, worked.W_O, h)
            if problem:
                raise ValueError(problem)
            F = worked.W_Q.shape[1]
            if d_k is not None and float(d_k) != F // h:
                raise ValueError(f"heads: d_k = {text_of(worked.d_k)} but {h} heads have width {F // h}")
            x = stages.observe_input("X", worked.X[None])                              # (1, L, D)
            kv = x if worked.X_kv is None else stages.observe_input("X_kv", worked.X_kv[None])
            kv_name = "X" if worked.X_kv is None else "X_kv"
            q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")
            k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)
            v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)
            q, k, v = (stages.split_heads(a, h, name=n) for a, n in ((q, "Q"), (k, "K"), (v, "V")))
            width = q.shape[-1]
        else:
            if start == "X":
                x = stages.observe_input("X", worked.X)
                kv = x if worked.X_kv is None else stages.observe_input("X_kv", worked.X_kv)
                kv_name = "X" if worked.X_kv is None else "X_kv"
                q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")
                k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)
                v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)
            elif start == "QK":
                q = stages.observe_input("Q", worked.Q)
                k = stages.observe_input("K", worked.K)
                v = None if worked.V is None else stages.observe_input("V", worked.V)
            else:
                q = k = None
                scores = stages.observe_input("scores", worked.scores, "scores (given)")
                v = None if worked.V is None else stages.observe_input("V", worked.V)
            width = q.shape[-1] if q is not None else None
            if worked.sink_logits is not None:          # one sink logit per head: a head axis (as run() does)
                q, k, v, scores = (None if a is None else a[None] for a in (q, k, v, scores))
        dd = d_k if d_k is not None else width
        if worked.rope is not None:                     # RoPE on every row, before the blocks (as attend does)
            rope = RoPE(theta=worked.rope["theta"], style=worked.rope["style"])
            q = rope(q, q_pos, name=Names.Q_ROT)
            k = rope(k, k_pos, name=Names.K_ROT)
    if substitute is None:
        _check_finite(main, worked)

    lead = (q if q is not None else scores).shape[:-2]
    n_lead = max(1, int(np.prod(lead)))
    block = max(1, int(block_cells or BLOCK_CELLS) // max(1, n_lead * S))
    keep_set = set(keep)
    merged: dict = {}
    order: list[str] = []
    out_full = None
    for r0 in range(0, L, block):
        r1 = min(L, r0 + block)
        opts = _options(worked, m, L, S, h, q_range=(r0, r1))
        opts.pop("rope", None), opts.pop("q_positions", None), opts.pop("k_positions", None)
        bt = Trace(substitute=None if substitute is None else functools.partial(_at_row, substitute, r0))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"), tracing(bt):
            pipeline.attend(None if q is None else q[..., r0:r1, :], k, v, scale=1.0 / math.sqrt(dd), d_k=dd,
                            scores=None if scores is None else scores[..., r0:r1, :], **opts)
        if substitute is None:
            _check_finite(bt, worked)
        local = [i - r0 for i in range(r0, r1) if i in keep_set]
        for st in bt:
            rec = merged.get(st.name)
            if rec is None:
                order.append(st.name)
                row_ops = tuple(key for key, val in st.operands.items()
                                if isinstance(val, np.ndarray) and val.ndim >= 2 and val.shape[-2] == r1 - r0
                                and (st.op != "matmul" or key == "a"))
                rec = merged[st.name] = {"first": st, "pieces": [], "ops": {key: [] for key in row_ops},
                                         "stats": {}}
            a = np.asarray(st.array)
            for li in np.ndindex(*a.shape[:-2]):
                sl = a[li]
                finite = sl[np.isfinite(sl)]
                n, lo, hi, tot, cnt = rec["stats"].get(li, (0, np.inf, -np.inf, 0.0, 0))
                if finite.size:
                    lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
                    tot, cnt = tot + float(finite.sum(dtype=np.float64)), cnt + finite.size
                rec["stats"][li] = (n + sl.size, lo, hi, tot, cnt)
            if st.name == Names.OUTPUT:
                if out_full is None:
                    out_full = np.empty(a.shape[:-2] + (L, a.shape[-1]), dtype=a.dtype)
                out_full[..., r0:r1, :] = a
            if local:
                rec["pieces"].append(a[..., local, :].copy())
                for key in rec["ops"]:
                    val = np.asarray(st.operands[key])
                    rec["ops"][key].append(val[..., local, :].copy())
        del bt
    for name in order:
        rec = merged[name]
        first = rec["first"]
        arr = np.concatenate(rec["pieces"], axis=-2)
        operands = dict(first.operands)
        for key, pieces in rec["ops"].items():
            operands[key] = np.concatenate(pieces, axis=-2)
        stats = {li: (n, lo, hi, tot / cnt) for li, (n, lo, hi, tot, cnt) in rec["stats"].items() if cnt}
        params = dict(first.params, rows=np.asarray(keep), full_shape=arr.shape[:-2] + (L, arr.shape[-1]),
                      stats=stats, row_operands=tuple(rec["ops"]))
        main.record(Step(name=name, op=first.op, formula=first.formula, array=arr, operands=operands,
                         params=params))
    if h == 1 and out_full is not None and worked.W_O is not None:      # as run(): one head's output · W_O
        with tracing(main):
            stages.project(out_full, worked.W_O, name="final_output", weight_name="W_O", input_name="output")
    if h > 1 and out_full is not None:
        W_O = worked.W_O
        D = worked.X.shape[1]
        plain = set(_options(worked, m, L, S, h, q_range=(0, 1))) <= {"mask", "mask_source"}
        square = (worked.W_Q.shape == (D, D) and worked.W_K.shape[1] == D and worked.W_V.shape[1] == D
                  and (W_O is None or W_O.shape == (D, D)))
        if W_O is None and square and plain:          # as run(): MultiHeadAttention, whose W_O is the identity
            W_O = np.eye(D)
        with tracing(main):
            out = stages.merge_heads(out_full)                                          # (1, L, H·Ev)
            if W_O is not None:
                stages.project(out, W_O, name="final_output", weight_name="W_O", input_name="concat")
    if substitute is None:
        _check_finite(main, worked)
    return main


def _at_row(substitute, row0: int, name: str, array):
    return substitute(name, array, row0)


#: steps whose −∞ entries are the mask's doing (not an overflow)
_MAY_HOLD_MINUS_INF = {"masked"}


def _check_finite(trace, worked: Worked) -> None:
    """Raise :class:`WorkedExampleError` at the first recorded step holding ±inf or NaN (a masked score's −∞
    aside): the numbers overflowed float64 there (e.g. scores of 1e200-sized vectors)."""
    for step in trace:
        a = np.asarray(step.array)
        if a.dtype.kind != "f":
            continue
        bad = np.isnan(a) | (np.isposinf(a) if step.name in _MAY_HOLD_MINUS_INF else np.isinf(a))
        if not bad.any():
            continue
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        value = "NaN" if np.isnan(a[idx]) else ("inf" if a[idx] > 0 else "-inf")
        where = worked.name or "worked example"
        raise WorkedExampleError(
            f"{where}: {step.name} overflowed: {step.name}{list(idx)} = {value} (float64 holds numbers up to "
            f"about 1.8e308); expected finite {step.name} — scale the inputs down")
