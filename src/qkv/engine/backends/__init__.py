"""Backends of qkv's attention, in one registry: objects with ``forward``, ``backward`` and ``supports``.

The contract is in :mod:`qkv.backends.base`. Built in: ``"reference"`` (the stages on whole arrays,
observable), ``"tiled"`` (the memory-efficient engine) and ``"torch"`` (torch's SDPA). Add one with
:func:`register` (a :class:`~qkv.backends.base.Backend` instance, or a function with the older signature
``fn(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng, return_weights,
return_lse=False, threads=None) -> (output, weights or None[, lse])``).

``backend="auto"`` asks the backends in registration order whether they support the request and prefer
its shapes; the reference takes what no other does. :func:`select` is the one place a backend is chosen,
forward and backward, with the reason (:mod:`qkv.backends.select`).
"""
from __future__ import annotations

from qkv.engine.backends.base import Backend, FunctionBackend  # noqa: F401  (re-exported)
from qkv.engine.backends.registry import BACKENDS, get, name_of, names, register  # noqa: F401  (re-exported)
from qkv.engine.backends.select import Problem, Request, select


def forward(backend, query, key, value, **kw):
    """Call a backend's forward whatever its kind: ``(output, weights or None, lse or None)``.

    A registered object runs ``backend.forward``; anything else callable (a test's stand-in, an older
    function) is called with the older signature.
    """
    if isinstance(backend, Backend):
        return backend.forward(query, key, value, **kw)
    return_lse = kw.pop("return_lse", False)
    flex = {k: kw.pop(k) for k in ("score_mod", "block_mask", "sink_logits") if k in kw}
    if any(v is not None for v in flex.values()):
        raise ValueError(f"backend: {backend!r} takes no score_mod, block_mask or sink_logits")
    if kw.get("threads") is None:
        kw.pop("threads", None)
    res = backend(query, key, value, return_lse=True, **kw) if return_lse else backend(query, key, value, **kw)
    return res[0], res[1], (res[2] if return_lse else None)


def choose_auto(query, key, value, *, enable_gqa: bool | None = None, **request) -> str:
    """The name of the backend ``backend="auto"`` runs (:func:`select`): the first registered backend that
    supports the request (``score_mod=``, ``block_mask=``, ``sink_logits=``, ``return_weights=``,
    ``dropout_p=``, ``backward=`` …, see :meth:`Backend.supports`) and prefers these shapes (the tiled engine:
    large scores, see :class:`qkv.backends.tiled.Limits`), else the reference.

    Args: validated query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev); ``enable_gqa``
    None means: grouped-query when the head counts differ.
    """
    b, _ = select(Request.of(None, **request), Problem(query, key, value, enable_gqa))
    return name_of(b)
