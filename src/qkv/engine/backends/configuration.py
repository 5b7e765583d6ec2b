"""``qkv.config(gemm=, kernels=, threads=, limits=)``: the engine's one configuration, for a ``with`` block.

One context variable (:mod:`qkv._settings`) holds what the calls inside the block use — the GEMM provider
(:mod:`qkv.gemm`), the block kernels (:mod:`qkv.kernels`), the tiled engine's worker threads and its limits
(:class:`qkv.backends.tiled.Limits`) — over one process default, which ``qkv.set_gemm``, ``qkv.set_kernels``
(``qkv.kernels.set_kernels``) and ``qkv.set_num_threads`` write. Nested blocks compose (the inner over the outer);
other threads keep theirs; the engine's workers see the block their task was started in (each task runs in a
copy of its caller's context). ``qkv.backends.tiled.limits(**changes)`` is ``config(limits=...)`` with the limits
in force, changed.

    with qkv.config(gemm="numpy", kernels="numpy", threads=1, limits={"block_q": 64}):
        out = qkv.scaled_dot_product_attention(q, k, v)
"""
from __future__ import annotations

import contextlib

from qkv import _checks, _settings
from qkv.compute import gemm as _gemm, kernels as _kernels
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled import thresholds as _thresholds

__all__ = ["config", "current"]


@contextlib.contextmanager
def config(*, gemm: str | None = None, kernels: str | None = None, threads: int | None = None, limits=None):
    """The engine's configuration for the calls inside the ``with`` block; restored on leaving. Yields the
    settings in force inside (:func:`current`).

    Args:
        gemm: ``"auto"``, ``"numpy"`` or ``"mkl"`` (see :func:`qkv.set_gemm`); None keeps the one in force.
        kernels: ``"auto"``, ``"numpy"`` or ``"numba"`` (see :func:`qkv.kernels.set_kernels`); None keeps it.
        threads: the tiled engine's worker threads (a positive int); None keeps them.
        limits: a :class:`qkv.backends.tiled.Limits`, or a dict of its fields to change in the limits in force
            (``{"block_q": 64, "backward_whole_scores": 0}``); None keeps them.

    Raises:
        TypeError / ValueError naming the argument, expected vs actual (an unknown provider, ``"mkl"`` or
        ``"numba"`` without its extra, a thread count that is not a positive int, an unknown limit).
    """
    fields = {}
    if gemm is not None:
        fields["gemm"] = _gemm.GEMM.check(gemm, "gemm")
    if kernels is not None:
        fields["kernels"] = _kernels.KERNELS.check(kernels, "kernels")
    if threads is not None:
        fields["threads"] = _checks.positive_int(threads, "threads")
    if limits is not None:
        fields["limits"] = _limits(limits)
    with _settings.override(**fields):
        yield current()


def current() -> _settings.Settings:
    """The settings in force here, every field resolved: the GEMM provider and kernels as chosen (``"auto"``
    unresolved), the worker threads, the limits."""
    return _settings.Settings(gemm=_gemm.GEMM.choice, kernels=_kernels.KERNELS.choice,
                              threads=RUNTIME.get_num_threads(), limits=_thresholds.current_limits())


def _limits(limits) -> _thresholds.Limits:
    if isinstance(limits, _thresholds.Limits):
        return limits
    if isinstance(limits, dict):
        return _thresholds.moved(**limits)
    raise TypeError(f"limits: expected a qkv.backends.tiled.Limits or a dict of its fields, got "
                    f"{type(limits).__name__}")
