"""Every user-facing string of qkv's explainer, checker, command line and page, as data: one JSON file per
language in this folder (``en.json``, ``zh.json``), a flat object ``{"key": "text with {placeholders}"}``.

    from qkv.locales import t, langs
    t("check.c_ok", "zh")                      # '所有声称的数都正确。'
    t("explain.step", "en", n=3)               # 'Step 3'

Adding a language is adding one file ``<code>.json`` with the same keys (copy ``en.json`` and translate the
values; keep every ``{placeholder}``): put it in this folder, or in a folder named by the environment variable
``QKV_LOCALES`` (several folders separated by ``os.pathsep``), or register a folder with
:func:`add_dir`. A file found later in that order (``QKV_LOCALES``, then :func:`add_dir`) replaces a
built-in one of the same code. A key missing from a language falls back to English. A file is checked
when it is loaded: a message with a ``{placeholder}`` its English one does not have (a renamed or mistyped
one) is a ValueError naming the file, the key and the placeholder.
"""
from __future__ import annotations

import json
import os
import re
import string
from importlib import resources

__all__ = ["t", "langs", "strings", "check_lang", "add_dir", "dirs", "placeholders", "DEFAULT"]

#: The language of every fallback.
DEFAULT = "en"
_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
_ADDED: list[str] = []
_CACHE: dict[str, tuple[tuple, dict]] = {}


def add_dir(path) -> None:
    """Also look for ``<code>.json`` locale files in ``path`` (after the built-in folder and ``QKV_LOCALES``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path: expected a folder of <code>.json locale files, got {path!r}")
    if path not in _ADDED:
        _ADDED.append(path)


def dirs() -> list[str]:
    """The folders searched, in order: the built-in one, ``QKV_LOCALES``'s, :func:`add_dir`'s."""
    out = [str(resources.files(__name__))]
    env = os.environ.get("QKV_LOCALES", "")
    out += [d for d in env.split(os.pathsep) if d]
    return out + _ADDED


def _files() -> dict[str, str]:
    found: dict[str, str] = {}
    for d in dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in sorted(names):
            code, ext = os.path.splitext(n)
            if ext == ".json" and _CODE.match(code):
                found[code] = os.path.join(d, n)
    return found


def langs() -> tuple[str, ...]:
    """The languages available now (the codes of the locale files), English first."""
    codes = sorted(_files())
    return tuple([c for c in codes if c == DEFAULT] + [c for c in codes if c != DEFAULT])


def _builtin_en() -> str:
    return os.path.join(str(resources.files(__name__)), f"{DEFAULT}.json")


def _fields(text: str) -> set[str]:
    """The names a string's ``{placeholders}`` take from the keyword arguments (``tok`` of ``{tok!r:>5}``, ``a``
    of ``{a.b}``; ``''`` or ``'0'`` for a positional one); ValueError for a stray brace."""
    return {re.split(r"[.\[!]", p, maxsplit=1)[0] for p in placeholders(text)}


def _check_placeholders(path: str, data: dict) -> None:
    """Every placeholder of a translated message is one its English message has (ValueError naming the first
    that is not, and how many more messages have one)."""
    en = _load(_builtin_en())
    bad = []
    for key, text in data.items():
        ref = en.get(key)
        if ref is None:
            continue
        try:
            want = _fields(ref)
        except ValueError:                                     # English's own text is not a format string
            continue
        if not want:
            continue
        try:
            unknown = sorted(_fields(text) - want)
        except ValueError as exc:
            bad.append(f"message {key!r}: {exc} (a literal brace is written {{{{ or }}}})")
            continue
        if unknown:
            names = ", ".join("{%s}" % u for u in unknown)
            bad.append(f"message {key!r} has the placeholder{'s' if len(unknown) > 1 else ''} {names}, which the "
                       f"English one does not have (it has {', '.join('{%s}' % w for w in sorted(want))})")
    if bad:
        more = f", and {len(bad) - 1} more message{'s' if len(bad) > 2 else ''} like it" if len(bad) > 1 else ""
        raise ValueError(f"locale file {path}: {bad[0]}{more}; keep every placeholder of {DEFAULT}.json as it is")


def _load(path: str) -> dict:
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"locale file {path}: expected a JSON object of strings ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"locale file {path}: expected a JSON object mapping keys to strings")
    if os.path.abspath(path) != os.path.abspath(_builtin_en()):
        _check_placeholders(path, data)
    _CACHE[path] = (stamp, data)
    return data


def check_lang(lang) -> str:
    """``lang`` when a locale file exists for it, else ValueError naming the choices."""
    if not isinstance(lang, str) or lang not in _files():
        raise ValueError(f"lang: expected one of {', '.join(langs())}, got {lang!r}")
    return lang


def strings(lang: str, prefix: str = "") -> dict[str, str]:
    """Every string of ``lang`` (English where it has none) whose key starts with ``prefix``."""
    check_lang(lang)
    files = _files()
    out = {k: v for k, v in _load(files[DEFAULT]).items() if k.startswith(prefix)}
    if lang != DEFAULT:
        out.update({k: v for k, v in _load(files[lang]).items() if k.startswith(prefix)})
    return out


def t(key: str, lang: str = DEFAULT, **kw) -> str:
    """The text of ``key`` in ``lang`` (English when the language lacks it), formatted with ``kw``."""
    files = _files()
    path = files.get(lang)
    if path is None:
        check_lang(lang)
    s = _load(path).get(key)
    if s is None:
        path = files[DEFAULT]
        s = _load(path).get(key)
        if s is None:
            raise KeyError(f"locale key {key!r}: not in {DEFAULT}.json")
    if not kw:
        return s
    try:
        return s.format(**kw)
    except (KeyError, IndexError, AttributeError, ValueError) as exc:     # what the load's check cannot see
        what = f"placeholder {{{exc.args[0]}}} is not one of {', '.join(sorted(kw))}" if isinstance(exc, KeyError) \
            else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"locale file {path}: message {key!r}: {what}") from None


def placeholders(text: str) -> set[str]:
    """The ``{placeholders}`` of a string (with their conversion, e.g. ``tok!r``)."""
    out = set()
    for _, field, _, conv in string.Formatter().parse(text):
        if field is not None:
            out.add(field + (f"!{conv}" if conv else ""))
    return out
