"""What a backend is: an object with ``forward``, ``backward`` and what it supports.

A backend computes attention on arrays that :mod:`qkv.sdpa` / :mod:`qkv.flex` have already validated::

    forward(query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale, enable_gqa=False,
            rng=None, return_weights=False, return_lse=False, threads=None,
            score_mod=None, block_mask=None, sink_logits=None)
        -> (output, weights or None, lse or None)

    backward(grad_out, query, key, value, *, attn_mask=None, is_causal=False, scale, enable_gqa=False,
             threads=None, score_mod=None, block_mask=None, sink_logits=None, out=None, lse=None)
        -> (grad_query, grad_key, grad_value) [+ (grad_sink_logits,) when sink_logits is given]

Shapes: query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev); output (..., Hq, L, Ev),
weights (..., Hq, L, S), lse (..., Hq, L) in the compute dtype (float32 for float16/32 inputs), −inf on a row
that may attend to nothing. ``scale`` is a float, ``attn_mask`` None or a bool (True = may attend) / float
(added) array broadcastable to the scores, never together with ``is_causal``. ``score_mod`` is a
:class:`qkv.mods.ScoreMod` (or a callable ``(score, b, h, q_idx, kv_idx) -> score``) applied to the scaled
scores, ``block_mask`` a :class:`qkv.flex.BlockMask`, ``sink_logits`` (Hq,) learned sink logits.

:meth:`Backend.supports` says whether a backend can run a request (``None``) or why not (a sentence), and
:meth:`Backend.preference` whether ``backend="auto"`` should take it for these shapes;
:func:`qkv.backends.select` asks each backend in turn.
"""
from __future__ import annotations


class Backend:
    """Base class of the attention backends (see the module docstring for the contract)."""

    #: the registry key
    name = "?"
    #: what it computes beyond plain attention: a subset of {"mask", "causal", "dropout", "weights", "lse",
    #: "score_mod", "block_mask", "sinks", "backward", "threads"}
    features: frozenset = frozenset()

    def supports(self, *, score_mod=None, block_mask=None, sink_logits=None, dropout_p=0.0,
                 return_weights=False, return_lse=False, backward=False, **_ignored) -> str | None:
        """None when this backend can run the request; otherwise the reason, as a sentence."""
        asked = {"score_mod": score_mod is not None, "block_mask": block_mask is not None,
                 "sinks": sink_logits is not None, "dropout": dropout_p > 0, "weights": return_weights,
                 "lse": return_lse, "backward": backward}
        missing = [k for k, on in asked.items() if on and k not in self.features]
        if missing:
            return f"the {self.name!r} backend does not compute {', '.join(missing)}"
        return None

    def prefers(self, query, key, value, *, enable_gqa: bool = False) -> bool:
        """Whether ``backend="auto"`` should pick this backend's forward for these (validated) shapes."""
        return False

    def prefers_backward(self, query, key, value, *, enable_gqa: bool = False) -> bool:
        """Whether ``backend="auto"`` should pick this backend's backward for these (validated) shapes."""
        return False

    def preference(self, query, key, value, *, enable_gqa: bool = False, backward: bool = False) -> tuple:
        """``(prefers, rule)``: :meth:`prefers` (or :meth:`prefers_backward`) and the rule behind it as a
        sentence for :func:`qkv.backends.select`'s reason (None: no rule to tell)."""
        ask = self.prefers_backward if backward else self.prefers
        return bool(ask(query, key, value, enable_gqa=enable_gqa)), None

    def forward(self, query, key, value, **kw):
        raise NotImplementedError(f"the {self.name!r} backend has no forward")

    def backward(self, grad_out, query, key, value, **kw):
        raise NotImplementedError(f"the {self.name!r} backend has no backward")

    def __call__(self, query, key, value, *, return_lse=False, **kw):
        """The older function signature: ``(output, weights)``, or ``(output, weights, lse)``."""
        out, weights, lse = self.forward(query, key, value, return_lse=return_lse, **kw)
        return (out, weights, lse) if return_lse else (out, weights)

    def __repr__(self) -> str:
        return f"<qkv backend {self.name!r}: {', '.join(sorted(self.features))}>"


class FunctionBackend(Backend):
    """A backend written as one function with the older signature (``fn(q, k, v, **kw) -> (out, w[, lse])``),
    as :func:`qkv.backends.register` receives it."""

    features = frozenset({"mask", "causal", "dropout", "weights", "lse"})

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def forward(self, query, key, value, *, return_lse=False, **kw):
        res = self.fn(query, key, value, return_lse=True, **kw) if return_lse else self.fn(query, key, value, **kw)
        return (res[0], res[1], res[2] if return_lse else None)
