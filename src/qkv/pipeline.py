"""The one orchestration of the stages: Q, K, V → (RoPE) → scores → scaled → (bias, cap) → masked → weights → output.

Every consumer that computes attention from whole arrays runs :func:`attend`: the reference backend (and so
:func:`qkv.scaled_dot_product_attention`, :func:`qkv.flex_attention`, :class:`qkv.MultiHeadAttention` on
small inputs), the worked-example runner and the checker. The tiled engine computes the same function block
by block; the tests hold the two together. A new step is written once here (as a stage in
:mod:`qkv.stages`) and every consumer — traces, explanations, the checker, pictures — sees it.

Shapes: q (..., H, L, E), k (..., H, S, E), v (..., H, S, Ev) with the key/value heads already matched to
the query heads (grouped-query attention repeats them before; see :mod:`qkv.shapes`). Masks are boolean,
**True = may attend**, or float (added); a bias (ALiBi) is a ``score_mod``, not a mask.
"""
from __future__ import annotations

import math
import numpy as np

from . import stages
from .stages import Names


def indices(lead: tuple, L: int, S: int, *, q_offset: int = 0, kv_offset: int = 0):
    """The index arrays a ``score_mod``/``mask_mod`` receives, broadcastable to ``lead + (L, S)``.

    ``b`` (the flattened batch dims before the head axis) and ``h`` (the head axis) are shaped
    ``lead + (1, 1)``-broadcastable, ``q_idx`` is (L, 1) and ``kv_idx`` (1, S) (offsets for blocks).
    """
    if len(lead) == 0:
        b = h = np.zeros((), np.int64)
    else:
        H = lead[-1]
        nb = math.prod(lead[:-1])
        b = np.arange(nb, dtype=np.int64).reshape(tuple(lead[:-1]) + (1, 1, 1))   # (..., 1, 1, 1)
        h = np.arange(H, dtype=np.int64).reshape(H, 1, 1)                          # (H, 1, 1)
    q_idx = np.arange(q_offset, q_offset + L, dtype=np.int64)[:, None]             # (L, 1)
    kv_idx = np.arange(kv_offset, kv_offset + S, dtype=np.int64)[None, :]          # (1, S)
    return b, h, q_idx, kv_idx


def attend(q, k, v, *, scale: float, d_k=None, mask=None, mask_source=None, score_mod=None, sink_logits=None,
           dropout_p: float = 0.0, rng=None, scores=None, rope=None, q_positions=None, k_positions=None):
    """Attention through the stages, each recorded into the active trace; returns ``(output, weights, lse)``.

    Args:
        q: (..., H, L, E) queries, or None when ``scores`` are given.
        k: (..., H, S, E) keys, or None when ``scores`` are given.
        v: (..., H, S, Ev) values, or None (the pipeline then stops at the weights; output is None).
        scale: the multiplier of the scores (1/√d_k by default at the public boundary).
        d_k: the d in √d_k, for the trace's formula (default the key width).
        mask: None, bool broadcastable to (..., H, L, S) (True = may attend) or float (added).
        mask_source: where the mask came from (a :class:`qkv.mods.MaskMod`, "causal", …), for the explainer.
        score_mod: a callable ``(score, b, h, q_idx, kv_idx) -> score`` applied to the scaled scores
            (:mod:`qkv.mods`: ALiBi records ``biased``, softcap ``capped``; any other records ``modified``).
        sink_logits: (H,) learned sink logits: each row's softmax denominator gains ``exp(sink_logits[h])``.
        dropout_p, rng: inverted dropout of the weights.
        scores: (..., L, S) raw scores given directly (the seeds' "scores" examples), instead of q and k.
        rope: a :class:`qkv.RoPE` applied to q and k first (recording ``Q_rot``, ``K_rot``), at
            ``q_positions`` / ``k_positions`` (default 0 … T−1).

    Returns:
        ``(output (..., H, L, Ev) or None, weights (..., H, L, S), lse (..., H, L))``.

    A trace with a ``substitute`` (see :class:`qkv.Trace`) may replace any step's result; the computation goes
    on with what it returns (the checker's "what follows from the claims").
    """
    if rope is not None:
        q = rope(q, q_positions, name=Names.Q_ROT)                               # (..., H, L, E)
        k = rope(k, k_positions, name=Names.K_ROT)                               # (..., H, S, E)
    if scores is None:
        s = stages.score(q, k)                                                   # (..., H, L, S)
        if d_k is None:
            d_k = q.shape[-1]
    else:
        s = scores
    s = stages.scale(s, scale, d_k=d_k)
    if score_mod is not None:
        lead, (L, S) = s.shape[:-2], s.shape[-2:]
        b, h, q_idx, kv_idx = indices(lead, L, S)
        s = apply_score_mod(score_mod, s, b, h, q_idx, kv_idx)
    s = stages.apply_mask(s, mask, source=mask_source)
    sinks = None
    if sink_logits is not None:
        sinks = np.asarray(sink_logits, dtype=s.dtype)
        sinks = sinks.reshape(-1, 1, 1) if s.ndim >= 3 else sinks.reshape(1, 1)   # (H, 1, 1); (1, 1) 2-D
    w, lse = stages.softmax(s, return_lse=True, sinks=sinks)                     # (..., H, L, S), (..., H, L)
    if dropout_p > 0:
        w = stages.dropout(w, dropout_p, rng)
    out = None if v is None else stages.weighted_sum(w, v)                       # (..., H, L, Ev)
    return out, w, lse


def apply_score_mod(score_mod, s, b, h, q_idx, kv_idx):
    """``score_mod(s, b, h, q_idx, kv_idx)``, recorded: a :mod:`qkv.mods` mod records its own step(s)
    (``biased``, ``capped``, through :func:`qkv.stages.add_bias` / :func:`qkv.stages.softcap`); any other
    callable is recorded as ``modified``. The result is checked (shape and dtype of ``s``) by
    :func:`qkv.mods.call_score_mod`."""
    from . import mods                                   # mods builds on the stages; imported when used
    from .tracing import record

    out = mods.call_score_mod(score_mod, s, b, h, q_idx, kv_idx)
    if not getattr(score_mod, "records", False):
        out = record(Names.MODIFIED, "score_mod", f"{Names.MODIFIED} = score_mod(scaled, b, h, i, j)", out,
                     operands={"scaled": s}, params={"fn": getattr(score_mod, "__name__", repr(score_mod))})
    return out
