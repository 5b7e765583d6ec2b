"""Reading worked-example files: YAML (a safe loader whose numbers keep their text) and JSON, bounded in size
and depth (:mod:`qkv.explain._bound`), every problem a one-line :class:`WorkedExampleError`."""
from __future__ import annotations

import json
import os
import re
from typing import Any

from qkv.explain._bound import bound
from qkv.explain._numbers import _MAX_INT_TEXT, Number, WorkedExampleError, _Int, _int_of, _YamlBool

_MAX_BYTES = 16 * 1024 * 1024


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
