"""The engine's public functions beside :func:`qkv.scaled_dot_product_attention`.

* :func:`scaled_dot_product_attention_backward` — gradients, tiled (FlashAttention-2 style).
* :func:`attention_weights` — chosen rows of the weights without the other rows.
* :func:`set_num_threads` / :func:`get_num_threads` — the tiled engine's worker threads.
* :class:`KVCache` (from :mod:`qkv.cache`) — keys and values kept across decoding steps.

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width.
Mask convention: a boolean mask is **True where attention is allowed**; a float mask is added to the scores.
"""
from __future__ import annotations

import numbers

import numpy as np

from qkv import _checks
from qkv.engine import backends
from qkv.compute import gemm
from qkv.core import shapes, stages
from qkv.engine.sdpa import validate
from qkv.engine.backends.tiled import get_num_threads, set_num_threads, thresholds as _thresholds
from qkv.core.cache import KVCache

__all__ = ["KVCache", "attention_weights", "get_num_threads", "scaled_dot_product_attention_backward",
           "set_num_threads"]

#: The default of :attr:`qkv.backends.tiled.Limits.backward_whole_scores` (2^18), kept as the name
#: docs/engine.md used to give it: a thin alias, read by nothing — the backward's size rule reads the limits in
#: force (move it with ``qkv.config(limits=...)`` or ``qkv.backends.tiled.limits(backward_whole_scores=...)``).
BACKWARD_WHOLE_SCORES = _thresholds.BACKWARD_WHOLE_SCORES


def scaled_dot_product_attention_backward(grad_out, query, key, value, attn_mask=None, is_causal=False,
                                          scale=None, enable_gqa=False):
    """Gradients of attention: ``(dL/dquery, dL/dkey, dL/dvalue)`` given ``grad_out = dL/doutput``.

    The same function as torch's autograd through ``scaled_dot_product_attention`` (without dropout),
    computed by the tiled engine: the forward runs once more to get the output and the log-sum-exp of each
    row, then each key block recomputes its probabilities ``P = exp(S − lse)`` instead of storing the
    (…, L, S) matrix (FlashAttention-2). Memory stays linear in L and S. Small problems (up to
    ``backward_whole_scores`` scores, :class:`qkv.backends.tiled.Limits`) run on whole arrays instead (the
    reference backend), where the tiled engine's per-block steps cost more than they save
    (:func:`qkv.backends.select` chooses).

    Args:
        grad_out: (..., Hq, L, Ev), the gradient of the loss with respect to the attention output.
        query: (..., Hq, L, E); key: (..., Hk, S, E); value: (..., Hk, S, Ev); one float dtype.
        attn_mask: None, bool (True = may attend) or float (added to the scores), broadcastable to
            (..., Hq, L, S). Not together with ``is_causal``.
        is_causal: top-left causal mask (query i sees keys 0..i).
        scale: multiplier of the scores; None means 1/√E.
        enable_gqa: Hk may divide Hq (grouped-query); a key/value head's gradient sums over its query heads.

    Returns:
        ``(grad_query, grad_key, grad_value)`` with the shapes and dtype of query, key, value (gradients of
        broadcast leading dimensions are summed, as autograd does). A query that may attend to nothing
        has output 0 and passes no gradient.

    Finite inputs never give NaN: where the scores or the gradients could overflow float32 (bounds in
    :func:`qkv._checks.range_check`), float16/float32 inputs are computed in float64; a ValueError where
    not even float64 holds them, or where a gradient itself does not fit the input dtype.
    """
    query, key, value, attn_mask, _, scale, _ = validate(query, key, value, attn_mask, 0.0, is_causal,
                                                          scale, enable_gqa, False, None, check_range=False)
    grad_out = _checks.float_array(grad_out, "grad_out", min_ndim=2)
    expected = shapes.output_shape(query.shape, key.shape, value.shape, enable_gqa)
    if grad_out.shape != expected:
        raise ValueError(f"grad_out: expected the output's shape {expected}, got {grad_out.shape}")
    if grad_out.dtype != query.dtype:
        raise TypeError(f"grad_out: expected dtype {query.dtype} (as query), got {grad_out.dtype}")
    dt = query.dtype
    if _checks.range_check(query, key, value, scale, grad_out=grad_out):     # float32 would overflow
        grad_out, query, key, value = (a.astype(np.float64) for a in (grad_out, query, key, value))
    b, _ = backends.select(backends.Request(backward=True), backends.Problem(query, key, value, enable_gqa))
    grads = b.backward(grad_out, query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                       enable_gqa=enable_gqa)
    if query.dtype == dt:
        return grads
    top = float(np.finfo(dt).max)
    for name, g in zip(("grad_query", "grad_key", "grad_value"), grads):
        big = float(np.max(np.abs(g)))
        if big > top:
            raise ValueError(f"{name}: the gradient reaches {big:.3g}, beyond {dt}'s range ({top:.3g}); "
                             f"computed in float64, it does not fit {dt}: rescale grad_out or the inputs")
    return tuple(g.astype(dt) for g in grads)


def attention_weights(query, key, rows, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """The attention weights of the chosen query rows only: ``softmax(Q[rows]·Kᵀ·scale + mask)``.

    For looking at one token of a long sequence: the cost is len(rows) × S, never L × S.

    Args:
        query: (..., Hq, L, E); key: (..., Hk, S, E), same dtype.
        rows: an int or a sequence of ints, indices into the L queries (negative counts from the end).
        attn_mask: None, bool (True = may attend) or float (added), broadcastable to (..., Hq, L, S).
        is_causal: top-left causal mask (query i sees keys 0..i).
        scale: multiplier of the scores; None means 1/√E.
        enable_gqa: Hk may divide Hq (grouped-query).

    Returns:
        (..., Hq, len(rows), S) weights in the input dtype (an int ``rows`` gives len 1); row r equals row
        ``rows[r]`` of the full weights. A row that may attend to nothing is all zeros. Rows whose scores
        could overflow float32 are computed in float64 (a ValueError beyond float64's range).
    """
    # key stands in for value: the weights do not depend on the values.
    query, key, _, attn_mask, _, scale, _ = validate(query, key, key, attn_mask, 0.0, is_causal, scale,
                                                      enable_gqa, False, None, check_range=False)
    L, S = query.shape[-2], key.shape[-2]
    idx = _rows(rows, L)
    out_dtype = query.dtype
    q = query[..., idx, :]                                               # (..., Hq, R, E)
    # float64 also where the chosen rows' scores would overflow float32 (a ValueError beyond float64)
    wide = _checks.range_check(q, key, None, scale)
    cdt = np.float64 if out_dtype == np.float64 or wide else np.float32
    q = q.astype(cdt) * cdt(scale)                                       # scale folded in
    k = key.astype(cdt, copy=False)
    if enable_gqa:
        hq, hk = query.shape[-3], key.shape[-3]
        n_rep = hq // hk
        k = k[..., :, None, :, :]                                         # (..., Hk, 1, S, E): no copy per head
        q = q.reshape(q.shape[:-3] + (hk, n_rep) + q.shape[-2:])           # (..., Hk, n_rep, R, E)
        s = gemm.matmul(q, np.swapaxes(k, -1, -2))                        # (..., Hk, n_rep, R, S)
        s = s.reshape(s.shape[:-4] + (hq,) + s.shape[-2:])                # (..., Hq, R, S)
    else:
        s = gemm.matmul(q, np.swapaxes(k, -1, -2))                        # (..., Hq, R, E) x (..., E, S)
    if is_causal:
        attn_mask = np.arange(S)[None, :] <= idx[:, None]                 # (R, S): the rows of causal(L, S)
    elif attn_mask is not None:
        m = attn_mask if attn_mask.ndim >= 2 else attn_mask.reshape((1,) * (2 - attn_mask.ndim) + attn_mask.shape)
        attn_mask = m if m.shape[-2] == 1 else m[..., idx, :]             # (..., R or 1, S)
    s = stages.apply_mask(s, attn_mask)
    return stages.softmax(s).astype(out_dtype, copy=False)               # fully masked rows → 0


def _rows(rows, L: int) -> np.ndarray:
    if isinstance(rows, (bool, np.bool_)):
        raise TypeError(f"rows: expected an int or a sequence of ints, got {rows!r}")
    if isinstance(rows, numbers.Integral):
        rows = [rows]
    try:
        idx = np.asarray(rows)
    except (TypeError, ValueError):
        raise TypeError(f"rows: expected an int or a sequence of ints, got {type(rows).__name__}") from None
    if (idx.dtype == object and idx.ndim == 1 and idx.size
            and all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in idx)):
        bad = next((int(r) for r in idx if not -L <= r < L), None)     # ints beyond int64: out of range
        if bad is not None:
            raise ValueError(f"rows: expected indices in [-{L}, {L}) (there are L={L} queries), got {bad}")
        idx = idx.astype(np.int64)
    if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"rows: expected an int or a non-empty sequence of ints, got {rows!r}")
    bad = idx[(idx < -L) | (idx >= L)]
    if bad.size:
        raise ValueError(f"rows: expected indices in [-{L}, {L}) (there are L={L} queries), got {int(bad[0])}")
    return np.where(idx < 0, idx + L, idx)
