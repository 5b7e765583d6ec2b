"""Explain and check: the textbook hand calculation of a :class:`qkv.Trace`, and a checker of worked examples.

- :func:`render` — a whole trace, step by step (text, markdown or JSON; English or Chinese).
- :func:`explain_query` — one query's calculation (also on batched multi-head traces such as a BERT layer).
- :mod:`qkv.explain.examples` — the built-in worked examples, the worked-example file format, and
  :func:`~qkv.explain.examples.run` (the example through qkv's own computation path → a Trace).
- :func:`check` — verify the numbers a worked example claims: ``correct``, ``carried`` or ``wrong``.
"""
from qkv.explain import examples
from qkv.explain.examples import Worked, WorkedExampleError, builtin_names, load_example, load_file, run
from qkv.explain.checker import CheckReport, ClaimResult, check
from qkv.explain.render import explain_query, render

__all__ = ["CheckReport", "ClaimResult", "Worked", "WorkedExampleError", "builtin_names", "check", "examples",
           "explain_query", "load_example", "load_file", "render", "run"]
