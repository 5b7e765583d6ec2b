"""The one place a backend is chosen, forward and backward: :func:`select` ``(request, problem) -> (backend, reason)``.

Every entry point asks it — :func:`qkv.scaled_dot_product_attention` and :func:`qkv.flex_attention` (through
:func:`qkv.sdpa.dispatch`), their backwards, :mod:`qkv.torch`'s autograd nodes and :func:`qkv.plan` — so a call
and its plan cannot disagree, and the reason is one sentence a plan prints and a trace keeps. The rule, in order:

1. torch tensors run on the ``"torch"`` backend (another name is a ValueError);
2. a named backend runs, if it supports the request (else a ValueError with its reason); a trace needs
   ``"reference"``, the one backend that records the stages;
3. a trace without a name: the reference;
4. ``None``/``"auto"``: the backends in registration order (the built-ins first, then what
   :func:`qkv.backends.register` added), each asked :meth:`~qkv.backends.base.Backend.supports` and
   :meth:`~qkv.backends.base.Backend.preference` (the tiled engine's size rule, forward and backward, from the
   limits in force: :class:`qkv.backends.tiled.Limits`); the first that supports and prefers runs; the
   reference — the fallback, asked last — takes the rest.
"""
from __future__ import annotations

import dataclasses

from qkv.engine.backends import registry as _registry
from qkv.engine.backends.base import Backend
from qkv.engine.backends.registry import get

__all__ = ["Problem", "Request", "select"]

#: The backend ``auto`` falls back to: it computes every request (``supports`` is always None) and records traces.
FALLBACK = "reference"
_FEATURES = ("score_mod", "block_mask", "sink_logits", "dropout_p", "return_weights", "return_lse")


@dataclasses.dataclass(frozen=True)
class Request:
    """What a call asks of a backend.

    ``backend``: None/"auto" or a registered name. ``backward``: the gradients. ``traced``: a trace is recording
    (the stages must run). ``torch_tensors``: the inputs are torch tensors. The rest as the call's arguments:
    what :meth:`qkv.backends.base.Backend.supports` reads."""
    backend: str | None = None
    backward: bool = False
    traced: bool = False
    torch_tensors: bool = False
    score_mod: object = None
    block_mask: object = None
    sink_logits: object = None
    dropout_p: float = 0.0
    return_weights: bool = False
    return_lse: bool = False

    @classmethod
    def of(cls, backend=None, **kw) -> "Request":
        """A request from a call's keyword arguments (those a backend does not read are left out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(backend, **{k: v for k, v in kw.items() if k in known})

    def asks(self) -> dict:
        """The keywords of :meth:`~qkv.backends.base.Backend.supports`."""
        return dict({k: getattr(self, k) for k in _FEATURES}, backward=self.backward)


class Problem:
    """The shapes a choice reads: validated query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev)
    (arrays, tensors or anything with ``shape`` and ``ndim``); ``enable_gqa`` None means grouped-query when the
    head counts differ."""

    __slots__ = ("query", "key", "value", "enable_gqa")

    def __init__(self, query, key, value, enable_gqa: bool | None = None):
        if enable_gqa is None:
            enable_gqa = query.ndim >= 3 and key.ndim >= 3 and query.shape[-3] != key.shape[-3]
        self.query, self.key, self.value, self.enable_gqa = query, key, value, bool(enable_gqa)


def select(request: Request, problem: Problem | None = None) -> tuple:
    """``(backend, reason)``: the backend the request runs on (the registry's entry) and why, as a sentence that
    starts with ``"torch tensors:"``, ``"named:"``, ``"traced:"`` or ``"auto:"``. ``problem`` is needed for
    ``auto`` only. A ValueError names the ``backend`` argument when the named one cannot run the request."""
    if request.torch_tensors:
        return _torch_tensors(request)
    if request.backend is not None and request.backend != "auto":
        return _named(request)
    if request.traced:
        return get(FALLBACK), "traced: only the reference backend records the stages"
    if problem is None:
        raise TypeError("problem: expected a Problem (the shapes) for backend=None/'auto', got None")
    get(FALLBACK)                                          # the built-ins registered
    declined = []
    for name, entry in list(_registry.BACKENDS.items()):
        if name == FALLBACK:
            continue
        b = _asked(name, entry)
        if b is None:
            continue
        why = b.supports(**request.asks())
        if why is not None:
            declined.append(why)
            continue
        yes, rule = b.preference(problem.query, problem.key, problem.value, enable_gqa=problem.enable_gqa,
                                 backward=request.backward)
        if yes:
            return entry, f"auto: {rule}" if rule else f"auto: the {name!r} backend prefers these shapes"
        if rule:
            declined.append(rule)
    why = "; ".join(declined) if declined else "no other backend takes it"
    return _registry.BACKENDS[FALLBACK], f"auto: {why} — the reference takes it"


def _asked(name: str, entry):
    """The object to ask about ``entry``: itself, or for a stand-in function registered in place of a built-in
    (a test's spy), the built-in of that name; None for other functions (:func:`register` wraps those)."""
    return entry if isinstance(entry, Backend) else _registry._BUILTIN.get(name)


def _named(request: Request) -> tuple:
    name = request.backend
    b = get(name)                                          # an unknown name is a ValueError listing the known
    if request.traced and name != FALLBACK:
        raise ValueError(f"backend: only 'reference' records a trace, got backend={name!r} with a trace; drop "
                         "one of them")
    why = b.supports(**request.asks()) if isinstance(b, Backend) else None
    if why is not None:
        instead = "None (auto)" if request.backward else "'tiled'"
        raise ValueError(f"backend: {why}; use backend='reference' or {instead}")
    return b, f"named: backend={name!r}"


def _torch_tensors(request: Request) -> tuple:
    if request.backend not in (None, "auto", "torch"):
        get(request.backend)                               # an unknown name is reported as such
        raise ValueError(f"backend: torch tensors run on the 'torch' backend, got {request.backend!r}; pass "
                         "NumPy arrays (tensor.numpy()) for the other backends")
    return get("torch"), "torch tensors: they run on torch's SDPA"
