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

from qkv.core import stages
from qkv.core.stages import Names


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
    s = stages.apply_mask(s, mask, source=mask_source, input_name=_modded_name(score_mod))
    sinks = None
    if sink_logits is not None:
        sinks = np.asarray(sink_logits, dtype=s.dtype)
        sinks = sinks.reshape(-1, 1, 1) if s.ndim >= 3 else sinks.reshape(1, 1)   # (H, 1, 1); (1, 1) 2-D
    w, lse = stages.softmax(s, return_lse=True, sinks=sinks)                     # (..., H, L, S), (..., H, L)
    if dropout_p > 0:
        w = stages.dropout(w, dropout_p, rng)
    out = None if v is None else stages.weighted_sum(w, v)                       # (..., H, L, Ev)
    return out, w, lse


def _modded_name(score_mod) -> str:
    """The name of the scores the mask is applied to: ``scaled``, or the last step a score mod records."""
    if score_mod is None:
        return Names.SCALED
    steps = getattr(score_mod, "step_names", ()) if getattr(score_mod, "records", False) else ()
    return steps[-1] if steps else Names.MODIFIED


def apply_score_mod(score_mod, s, b, h, q_idx, kv_idx):
    """``score_mod(s, b, h, q_idx, kv_idx)``, recorded: a :mod:`qkv.mods` mod records its own step(s)
    (``biased``, ``capped``, through :func:`qkv.stages.add_bias` / :func:`qkv.stages.softcap`); any other
    callable is recorded as ``modified``. The result is checked (shape and dtype of ``s``) by
    :func:`qkv.mods.call_score_mod`."""
    from qkv.core import mods                                   # mods builds on the stages; imported when used
    from qkv.core.tracing import record

    out = mods.call_score_mod(score_mod, s, b, h, q_idx, kv_idx)
    if not getattr(score_mod, "records", False):
        out = record(Names.MODIFIED, "score_mod", f"{Names.MODIFIED} = score_mod(scaled, b, h, i, j)", out,
                     operands={"scaled": s}, params={"fn": getattr(score_mod, "__name__", repr(score_mod))})
    return out


def layer(x, w_q, w_k, w_v, w_o=None, *, x_kv=None, x_v=None, b_q=None, b_k=None, b_v=None, b_o=None,
          heads: int | None = None, kv_heads: int | None = None, rope=None, positions=None, kv_positions=None,
          cache=None, attend=None, row_block: int | None = None):
    """The attention layer, the one orchestration of its steps, each recorded into the active trace:
    X → Q, K, V → [split heads] → [RoPE] → [KV cache] → attend → [concat heads] → [· W_O].

    :class:`qkv.MultiHeadAttention`, :func:`qkv.attention` and the worked-example runner all run this; they
    differ only in the ``attend`` they give (the dispatching :func:`qkv.scaled_dot_product_attention`, the
    reference, or :func:`attend` with an example's mask and mods).

    Args:
        x: (..., L, D) the query-side token vectors; ``x_kv`` (..., S, D_kv) the key/value side (None: ``x``);
            ``x_v`` the value side when it differs from the keys' (None: ``x_kv``).
        w_q, w_k, w_v: (D, H·E), (D_kv, Hk·E), (D_kv, Hk·Ev) projections in the seeds' layout (``Q = X · W_Q``);
            ``b_q``, ``b_k``, ``b_v`` their biases or None.
        w_o, b_o: the output projection (H·Ev, D_out) and its bias, or None (the layer ends at the attention
            output, or at the concat of the heads).
        heads: None — one head without a head axis (the seeds' (L, E) arrays); H — Q splits into H heads
            (x must be (B, L, D)), K and V into ``kv_heads`` (default H).
        rope, positions, kv_positions: a :class:`qkv.RoPE` rotating Q at ``positions`` and K at
            ``kv_positions`` (default ``positions``) after the split, before the cache.
        cache: a :class:`qkv.KVCache`: the new keys and values are appended and the queries attend to all.
        attend: ``attend(q, k, v, rows) -> (output, aux)``, the attention of the queries q (…, Lr, E) — the
            rows ``rows = (r0, r1)`` of L — over k, v; default :func:`attend` with scale 1/√E.
        row_block: query rows per ``attend`` call (None: all L at once); every query row needs only its own
            q and all of K and V, so the blocks' outputs are stacked.

    Returns:
        ``(output, aux)``: output (..., L, D_out) (or (..., L, H·Ev) / (..., L, Ev) without ``w_o``); aux is
        what ``attend`` returned beside the output (a list of them, one per block, with ``row_block``).
    """
    stages.observe_input("X", x)
    kv_in = x if x_kv is None else stages.observe_input("X_kv", x_kv)
    kv_name = "X" if x_kv is None else "X_kv"
    q = stages.project(x, w_q, b_q, name="Q", weight_name="W_Q", input_name="X")                # (..., L, H·E)
    k = stages.project(kv_in, w_k, b_k, name="K", weight_name="W_K", input_name=kv_name)       # (..., S, Hk·E)
    v_in = kv_in if x_v is None else x_v
    v = stages.project(v_in, w_v, b_v, name="V", weight_name="W_V", input_name=kv_name)       # (..., S, Hk·Ev)
    if heads is not None:
        hk = heads if kv_heads is None else kv_heads
        q = stages.split_heads(q, heads, name="Q")                                             # (B, H, L, E)
        k = stages.split_heads(k, hk, name="K")                                                # (B, Hk, S, E)
        v = stages.split_heads(v, hk, name="V")                                                # (B, Hk, S, Ev)
    if rope is not None:
        q = rope(q, positions, name=Names.Q_ROT)
        k = rope(k, positions if kv_positions is None else kv_positions, name=Names.K_ROT)
    if cache is not None:
        k, v = cache.append(k, v)                                                              # (B, Hk, S', E)
    if attend is None:
        attend = _plain(1.0 / math.sqrt(q.shape[-1]))
    out, aux = attend_rows(attend, q, k, v, row_block)                                        # (..., L, Ev)
    if heads is not None:
        out = stages.merge_heads(out)                                                          # (B, L, H·Ev)
    if w_o is not None:
        out = stages.project(out, w_o, b_o, name="final_output", weight_name="W_O",
                             input_name="concat" if heads is not None else "output")          # (..., L, D_out)
    return out, aux


def _plain(scale: float):
    """:func:`attend` without mask or mods as a layer's ``attend``: returns (output, weights)."""
    def plain(q, k, v, rows):
        out, w, _ = attend(q, k, v, scale=scale)
        return out, w
    return plain


def attend_rows(attend, q, k, v, row_block):
    """``attend`` over all query rows at once, or over blocks of ``row_block`` rows, their outputs stacked."""
    L = q.shape[-2]
    if row_block is None or row_block >= L:
        return attend(q, k, v, (0, L))
    outs, auxes = [], []
    for r0 in range(0, L, row_block):
        r1 = min(L, r0 + row_block)
        o, a = attend(q[..., r0:r1, :], k, v, (r0, r1))
        outs.append(o)
        auxes.append(a)
    out = None if outs[0] is None else np.concatenate(outs, axis=-2)                          # (..., L, Ev)
    return out, auxes
