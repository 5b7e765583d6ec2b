"""Trace: what the pipeline's stages computed, in order.

A :class:`Trace` does not compute anything. The stages in :mod:`qkv.stages` call :func:`record` with the
arrays they have just produced (and the operands they used); when a trace is active, it keeps them. The
explainer, the checker and the pictures render a trace; they never recompute attention.

Activate a trace with the context manager ``qkv.trace()``::

    with qkv.trace() as t:
        out = qkv.scaled_dot_product_attention(q, k, v)
    t["weights"].array        # the softmax the reference path computed

or pass ``trace=`` to :func:`qkv.attention`, :func:`qkv.scaled_dot_product_attention` or
:meth:`qkv.MultiHeadAttention.forward`.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from qkv import _display

_ACTIVE: contextvars.ContextVar["Trace | None"] = contextvars.ContextVar("qkv_trace", default=None)


@dataclass
class Step:
    """One stage's record.

    name      stable key ("X", "Q", "scores", "scaled", "masked", "weights", "output", ...)
    op        what kind of stage: input, matmul, scale, mask, softmax, dropout, reshape, repeat
    formula   the formula as the seeds write it, e.g. ``"Q = X · W_Q"``
    array     the stage's output, exactly as the computation produced it
    operands  the arrays the stage used, by role (e.g. ``{"a": X, "b": W_Q, "bias": b_Q}``)
    params    scalars and flags (e.g. ``{"scale": 0.577, "d_k": 3}``)
    """

    name: str
    op: str
    formula: str
    array: np.ndarray
    operands: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def terms(self, index: tuple[int, ...]) -> list[tuple[float, float]]:
        """The (left, right) factor pairs whose products sum to ``array[index]`` for a matmul stage.

        For ``C = A · B`` (or ``A · Bᵀ`` when ``params["transpose_b"]``) the element ``C[..., i, j]`` is
        ``Σ_k A[..., i, k] · B[..., k, j]``; this returns those pairs, read from the recorded operands.
        """
        if self.op != "matmul":
            raise ValueError(f"terms: step {self.name!r} is a {self.op} stage, expected a matmul stage")
        a, b = self.operands["a"], self.operands["b"]
        lead_shape = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        a = np.broadcast_to(a, lead_shape + a.shape[-2:])
        b = np.broadcast_to(b, lead_shape + b.shape[-2:])
        *lead, i, j = index
        row = a[(*lead, i)]                                        # (E,)
        col = b[(*lead, j)] if self.params.get("transpose_b") else b[(*lead, slice(None), j)]
        return [(float(x), float(y)) for x, y in zip(row, col)]


class Trace:
    """The ordered steps of one computation. ``trace[name]`` is the latest step of that name.

    ``substitute(name, array) -> array``, when given, is called with every step's result; what it returns
    is what the computation continues with (the checker puts a worked example's claimed numbers in place this
    way, to see what follows from them). The step keeps the value the stage computed.

    ``backends`` lists, per attention call recorded, ``(backend, reason)`` as :func:`qkv.backends.select` chose
    it (a traced call runs on the reference, the one backend that records the stages).
    """

    def __init__(self, substitute=None) -> None:
        self.steps: list[Step] = []
        self.substitute = substitute
        self.backends: list[tuple[str, str]] = []

    def chose(self, backend: str, reason: str) -> None:
        """Keep the backend an attention call recorded here ran on, and why."""
        self.backends.append((backend, reason))

    def record(self, step: Step) -> None:
        self.steps.append(step)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __contains__(self, name: str) -> bool:
        return any(s.name == name for s in self.steps)

    def __getitem__(self, name: str) -> Step:
        for s in reversed(self.steps):
            if s.name == name:
                return s
        raise KeyError(f"trace has no step {name!r}; it has {[s.name for s in self.steps]}")

    def names(self) -> list[str]:
        return [s.name for s in self.steps]

    def __repr__(self) -> str:
        inner = ", ".join(f"{s.name}{s.shape}" for s in self.steps)
        return f"Trace([{inner}])"

    def _repr_html_(self) -> str | None:
        """In a notebook: the offline page of the recorded weights (:func:`qkv.viz.show`)."""
        if "weights" not in self:
            return None
        return _display.html(self)


def active() -> Trace | None:
    """The trace that stages record into now, or None."""
    return _ACTIVE.get()


def record(name: str, op: str, formula: str, array: np.ndarray, **kw) -> np.ndarray:
    """Called by a stage after it computed ``array``; returns the array the computation goes on with.

    Without an active trace: nothing is kept and ``array`` is returned. With one: the step is kept, and the
    trace's ``substitute`` (if any) may return another array to continue with.
    """
    t = _ACTIVE.get()
    if t is None:
        return array
    t.record(Step(name=name, op=op, formula=formula, array=array,
                  operands=kw.get("operands", {}), params=kw.get("params", {})))
    if t.substitute is not None:
        return t.substitute(name, array)
    return array


@contextlib.contextmanager
def trace(into: Trace | None = None) -> Iterator[Trace]:
    """Record every stage run inside the ``with`` block into a :class:`Trace` (a new one by default)."""
    t = Trace() if into is None else into
    if not isinstance(t, Trace):
        raise TypeError(f"trace: expected a qkv.Trace or None, got {type(t).__name__}")
    token = _ACTIVE.set(t)
    try:
        yield t
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def maybe(into: Trace | None) -> Iterator[Trace | None]:
    """``trace(into)`` when ``into`` is given, otherwise leave whatever is active alone."""
    if into is None:
        yield _ACTIVE.get()
    else:
        with trace(into) as t:
            yield t
