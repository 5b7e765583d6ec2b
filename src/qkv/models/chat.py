"""A model file's chat template, rendered in jinja2's sandbox with limits on time, memory and output.

A GGUF file's ``tokenizer.chat_template`` is a program written by whoever made the file. It runs in
:class:`jinja2.sandbox.ImmutableSandboxedEnvironment` (the settings transformers uses: ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``raise_exception``) and, on top of what the sandbox refuses:

- rendering stops after :data:`MAX_SECONDS` (a trace function on the rendering thread looks at the clock on
  every line the template's code and jinja's runtime run, so a loop that never ends is stopped), or when the
  process has grown by :data:`MAX_GROWTH_MB` while rendering (read from ``/proc/self/statm``);
- the output is collected piece by piece and refused beyond :data:`MAX_OUTPUT` characters (more than the
  input gave it), so two nested ``range(100000)`` loops stop at the limit, not at 5 GB;
- operations that make a large value in one step (``'x' * 10**9``, ``2 ** 10**9``, ``'a'.ljust(10**9)``,
  ``'x'|center(10**9)``, ``'{:>999999999}'.format(1)``) are refused before they run; the compiler's
  constant folding is off, so nothing is evaluated while compiling.

Every failure — a syntax error, the sandbox's SecurityError, ``range(10**9)``'s OverflowError, a limit,
MemoryError, an error raised by the template itself — is one :class:`ValueError`:
``FILE: tokenizer.chat_template: the problem``.
"""
from __future__ import annotations

import functools
import numbers
import os
import re
import sys
import time

#: The longest a template may take to render.
MAX_SECONDS = 2.0
#: The most characters a rendering may produce beyond twice the messages it was given.
MAX_OUTPUT = 1 << 20
#: The most the process may grow while rendering.
MAX_GROWTH_MB = 512
#: The largest integer argument (a width, a count) a call, filter or operator may get.
MAX_INT_ARG = 1 << 20

_BIG_WIDTH = re.compile(r"(?:%|\{[^{}]*:)[^{}%a-zA-Z]*?\d{7,}")


class _Refused(Exception):
    """A limit of this module (its message says which)."""


def _cut(s, n: int = 160) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[:n - 1] + "…"


def _check_ints(values) -> None:
    for v in values:
        if isinstance(v, numbers.Integral) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
            raise _Refused(f"an argument of {_cut(v, 24)} (expected at most {MAX_INT_ARG:,}: a width or count "
                           "that large would make a huge value)")


def _check_format(fmt) -> None:
    if isinstance(fmt, str) and _BIG_WIDTH.search(fmt):
        raise _Refused(f"a format with a width of 7 digits or more ({_cut(fmt, 40)!r})")


def _check_binop(op: str, left, right) -> None:
    seq = (str, list, tuple)
    if op == "*":
        for a, b in ((left, right), (right, left)):
            if isinstance(a, seq) and isinstance(b, numbers.Integral) and len(a) * int(b) > MAX_OUTPUT:
                raise _Refused(f"a sequence of {len(a):,} repeated {_cut(b, 24)} times (over {MAX_OUTPUT:,} items)")
    elif op == "+":
        if isinstance(left, seq) and isinstance(right, seq) and len(left) + len(right) > MAX_OUTPUT:
            raise _Refused(f"a value of {len(left) + len(right):,} items (over {MAX_OUTPUT:,})")
    elif op == "**":
        if (isinstance(left, numbers.Number) and isinstance(right, numbers.Number)
                and abs(right) > 1024 and abs(left) not in (0, 1)):
            raise _Refused(f"a power with exponent {_cut(right, 24)} (expected at most 1024)")
    elif op == "%":
        _check_format(left)


def _environment(file: str):
    from jinja2.exceptions import SecurityError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, /, *args, **kwargs):
            if obj is not safe_range:                     # range() has the sandbox's own limit (100,000)
                _check_ints(args), _check_ints(kwargs.values())
            return super().call(context, obj, *args, **kwargs)

        def wrap_str_format(self, value):
            if getattr(value, "__name__", "") in ("format", "format_map"):
                _check_format(getattr(value, "__self__", None))
            return super().wrap_str_format(value)

        def unsafe_undefined(self, obj, attribute):       # refused where it is read, not printed as ''
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def raise_exception(message):
        raise _Raised(_cut(message))

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], optimized=False)
    env.globals["raise_exception"] = raise_exception
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    return env


class _Raised(Exception):
    """The template called raise_exception(message)."""


def _bounded_filter(name: str, f):
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_ints(args[1:] if not hasattr(f, "jinja_pass_arg") else args[2:]), _check_ints(kwargs.values())
        if name == "format":
            _check_format(args[0] if not hasattr(f, "jinja_pass_arg") else args[1])
        return f(*args, **kwargs)
    return bounded


def compile_template(source: str, file: str):
    """The compiled template; a syntax error (or anything else the compiler refuses) is a ValueError."""
    try:
        from jinja2 import TemplateSyntaxError
    except ImportError:
        raise ImportError("chat=True needs jinja2: pip install 'qkv[llama]'") from None
    try:
        with _Limits():
            return _environment(file).from_string(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"{file}: tokenizer.chat_template: syntax error at line {e.lineno}: "
                         f"{_cut(e.message)}") from None
    except (_Refused, MemoryError, RecursionError) as e:
        raise ValueError(f"{file}: tokenizer.chat_template: {_problem(e)}") from None


def render(template, file: str, **context) -> str:
    """``template.render(**context)`` within the limits; every failure one ValueError naming ``file``."""
    size = sum(len(m.get("content") or "") for m in context.get("messages", []))
    limit = MAX_OUTPUT + 2 * size
    parts: list[str] = []
    n = 0
    try:
        with _Limits():
            for piece in template.generate(**context):
                n += len(piece)
                if n > limit:
                    raise _Refused(f"it rendered more than {limit:,} characters")
                parts.append(piece)
    except Exception as e:                         # the template is the file's program: all of it is its problem
        raise ValueError(f"{file}: tokenizer.chat_template: {_problem(e)}") from None
    return "".join(parts)


def _problem(e: BaseException) -> str:
    from jinja2.exceptions import SecurityError, TemplateError

    if isinstance(e, (_Refused,)):
        return f"stopped: {e}"
    if isinstance(e, _Raised):
        return f"the template raised an error: {e}"
    if isinstance(e, SecurityError):
        return f"refused by the sandbox: {_cut(e)}"
    if isinstance(e, MemoryError):
        return "ran out of memory while rendering"
    if isinstance(e, RecursionError):
        return "nested too deeply (a macro that calls itself without end?)"
    if isinstance(e, OverflowError):
        return f"too large: {_cut(e)}"
    if isinstance(e, TemplateError):
        return f"{type(e).__name__}: {_cut(e)}"
    return f"{type(e).__name__} while rendering: {_cut(e)}"


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * 4096 / 2**20
    except (OSError, ValueError, IndexError):          # pragma: no cover - not Linux
        return None


@functools.lru_cache(maxsize=1)
def _jinja_dir() -> str:
    import jinja2
    return os.path.dirname(jinja2.__file__) + os.sep


def _rendering(code) -> bool:
    """Whether ``code`` is the template's (compiled from a string: ``<template>``), jinja's runtime or this
    module's (the sandbox's calls) — the code the limits watch and stop."""
    name = code.co_filename
    return name == "<template>" or name == __file__ or name.startswith(_jinja_dir())


class _Limits:
    """A trace function on this thread, for the time of a ``with``: every line run of the template's code and
    jinja's runtime looks at the clock, and every 256th at the process's size; an earlier trace function
    (a debugger, coverage) keeps getting its events. Other code that runs meanwhile on this thread — a garbage
    collector's callback (hypothesis installs one), a library's hook — is neither watched nor stopped: a
    refusal raised there was swallowed as an unraisable exception, tracing went off, and the render went on
    unwatched to a TypeError, or crashed the interpreter."""

    def __enter__(self):
        self.old = sys.gettrace()
        self.deadline = time.monotonic() + MAX_SECONDS
        self.rss0 = _rss_mb()
        self.lines = 0
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.old)
        return False

    def _check(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Refused(f"still rendering after {MAX_SECONDS:g} s (a loop that does not end?)")
        self.lines += 1
        if self.rss0 is not None and self.lines % 256 == 0:
            rss = _rss_mb()
            if rss is not None and rss - self.rss0 > MAX_GROWTH_MB:
                raise _Refused(f"it took more than {MAX_GROWTH_MB} MB of memory")

    def _global(self, frame, event, arg):
        old_local = self.old(frame, event, arg) if self.old is not None else None
        if not _rendering(frame.f_code):
            return old_local

        def local(frame, event, arg):
            nonlocal old_local
            if event == "line":
                self._check()
            if old_local is not None:
                old_local = old_local(frame, event, arg)
            return local
        self._check()
        return local
