"""``qkv.plan``: what a call of :func:`qkv.flex_attention` / :func:`qkv.scaled_dot_product_attention` (or their
backward) would do, without computing attention.

The backend and its reason come from :func:`qkv.backends.select`, the function the call asks, and for the tiled engine the plan comes from the code the call runs
(:mod:`qkv.backends.tiled.schedule`): block sizes, split-K, workers, and per task the strategy, the reason it was
chosen and the pieces. ``print(plan)`` shows it as a table; :func:`qkv.backends.tiled.proof.check` proves it
against the mask.
"""
from __future__ import annotations

from qkv.engine import backends, flex, sdpa
from qkv.core import shapes
from qkv.engine.backends.tiled import proof as _proof, schedule as _schedule
from qkv.engine.backends.tiled.schedule import Piece, Plan, TaskPlan

__all__ = ["plan", "check_plan", "Plan", "TaskPlan", "Piece"]


def plan(query, key, value, *, score_mod=None, block_mask=None, attn_mask=None, is_causal=False, sink_logits=None,
         enable_gqa=False, backward=False, scale=None, backend=None, threads=None) -> Plan:
    """The plan of an attention call, made by the code the call runs, without computing attention.

    Args:
        query, key, value: as :func:`qkv.flex_attention` — (B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev) (or
            3-/2-D), one float dtype.
        score_mod, block_mask, sink_logits: as :func:`qkv.flex_attention`.
        attn_mask, is_causal: as :func:`qkv.scaled_dot_product_attention` (a boolean mask is True where
            attention is allowed; ``is_causal`` top-left).
        enable_gqa: grouped-query heads (Hq a multiple of Hk).
        backward: the plan of the backward's key-block tasks instead of the forward's.
        scale, backend, threads: as the call's (None: 1/√E, ``backend="auto"``'s choice, the engine's threads).

    Returns:
        A :class:`qkv.backends.tiled.schedule.Plan`: ``backend`` and ``reason``, the shapes, ``block_q``,
        ``block_k``, ``split_k``, ``workers``, and ``tasks`` (each a ``TaskPlan``: its rows, keys, strategy,
        reason and ``pieces``); no tasks where the backend is not the tiled engine (it computes every head's
        scores at once). ``print(plan)`` renders it; ``plan.work_fraction()`` is the share of the L·S scores
        per head it computes.
    """
    p = flex.prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, sink_logits, check_range=True)
    q, k, v = p.q, p.k, p.v
    _, _, _, mask, _, _, _ = sdpa.validate(q, k, v, attn_mask, 0.0, is_causal, p.scale, p.enable_gqa, False, None,
                                            check_range=False)
    request = dict(score_mod=p.score_mod, block_mask=p.block_mask, sink_logits=p.sink_logits)
    kw = dict(attn_mask=mask, is_causal=bool(is_causal), scale=p.scale, enable_gqa=p.enable_gqa, threads=threads,
              **request)
    if backward:
        flex._check_backward_mod(p)
    b, reason = backends.select(backends.Request(backend, backward=bool(backward), **request),
                                backends.Problem(q, k, v, p.enable_gqa))
    name = backends.name_of(b)
    if name != "tiled":
        lead = shapes.lead(q.shape, k.shape, p.enable_gqa)
        return Plan("backward" if backward else "forward", name, reason, lead, q.shape[-2], k.shape[-2],
                    causal=bool(is_causal))
    if backward:
        return _schedule.backward_plan(q, k, v, reason=reason, **kw)
    return _schedule.forward_plan(q, k, v, reason=reason, **kw)


def check_plan(p: Plan) -> None:
    """Prove a tiled plan against its mask (:func:`qkv.backends.tiled.proof.check`): every allowed score kept
    exactly once, nothing else, every row's state written before it is added to. Raises ``PlanError``."""
    if p.tasks:
        _proof.check(p)
