"""FlexAttention in NumPy: attention variants written as small functions, forward and backward.

:func:`flex_attention` has the semantics of torch's ``torch.nn.attention.flex_attention.flex_attention``:
the scaled scores go through a ``score_mod`` (ALiBi, soft-capping, your own), a ``block_mask`` built once from
a ``mask_mod`` with :func:`create_block_mask` says which keys each query may see (causal, sliding window,
prefix LM, packed documents, StreamingLLM's sinks …; see :mod:`qkv.mods`), and learned ``sink_logits`` (gpt-oss)
add a column to each row's softmax denominator. :func:`flex_attention_backward` gives the gradients, with
every built-in mod's derivative. Both validate every argument at the boundary, then run on a backend from
:mod:`qkv.backends` (the tiled engine when it supports the request and the inputs are large, the reference
otherwise).

Shape legend: B batch, Hq query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value
width. ``query (B, Hq, L, E)``, ``key (B, Hk, S, E)``, ``value (B, Hk, S, Ev)`` as in torch; also
``(Hq, L, E)`` / ``(Hk, S, E)`` (``b`` is 0 then) and ``(L, E)`` / ``(S, E)`` (``b`` and ``h`` are 0). Leading
dimensions of size 1 broadcast (a key of batch 1 serves every query batch row). Mask convention: True = may
attend.
"""
from __future__ import annotations

import numpy as np

from qkv import _checks
from qkv.engine import backends, sdpa
from qkv.core import mods, shapes
from qkv.core.blockmask import BlockMask, create_block_mask

__all__ = ["BlockMask", "create_block_mask", "flex_attention", "flex_attention_backward"]


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, *, sink_logits=None, backend=None, threads=None):
    """Attention ``softmax(score_mod(Q·Kᵀ · scale) masked by block_mask [, sinks]) · V``, torch's FlexAttention.

    Args:
        query: (B, Hq, L, E), (Hq, L, E) or (L, E), float16/32/64.
        key: (B, Hk, S, E) (or 3-/2-D likewise), the same dtype; B broadcasts with the query's.
        value: (B, Hk, S, Ev), the same dtype.
        score_mod: None, or ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to the scaled scores,
            called with NumPy arrays that broadcast over a block: ``score`` (…, Lb, Sb), ``q_idx`` (Lb, 1),
            ``kv_idx`` (1, Sb), ``b``/``h`` shaped to broadcast — so a mod written with operators and ufuncs
            works unchanged. :mod:`qkv.mods`: ``alibi``, ``softcap``, ``compose``. It must return a float
            array of the score's shape (or broadcasting to it); ``-inf`` removes a key, ``+inf``/NaN is an
            error.
        block_mask: None (every key visible), or a :class:`BlockMask` from :func:`create_block_mask` built for
            (B or None, Hq or None, L, S).
        scale: multiplier of the scores; None means 1/√E.
        enable_gqa: Hk may divide Hq; key/value head h serves query heads h·Hq/Hk … (h+1)·Hq/Hk − 1 (``h`` in
            the mods is the query head).
        return_lse: also return the log-sum-exp (natural log) of each row of the modified, masked, scaled
            scores, sink term included: ``log(Σ_j exp(s_ij) + exp(sink_h))``.
        sink_logits: None, or (Hq,) learned attention sinks (gpt-oss): each row's softmax denominator
            gains ``exp(sink_logits[h])``, a column that takes weight but contributes no value.
        backend: None/"auto" (the tiled engine when it supports the request and the scores are large, the
            reference otherwise), or "reference" / "tiled".
        threads: worker threads of the tiled engine for this call.

    Returns:
        output (…, Hq, L, Ev) in the input dtype; ``(output, lse)`` with ``return_lse``, lse (…, Hq, L) in the
        compute dtype (float32 for float16/32, float64 for float64). A query that may attend to nothing gets
        output 0 and lse −inf (with sinks: weights 0, output 0, lse = its sink logit). float16 is computed in
        float32.

    Raises:
        TypeError / ValueError naming the argument, expected vs actual (see :func:`qkv.scaled_dot_product_attention`
        for query, key, value, scale, enable_gqa).

    Finite inputs never give NaN: where the scores could overflow float32, float16/float32 inputs are computed
    in float64 (and the output cast back; lse then stays float64), as in :func:`qkv.scaled_dot_product_attention`;
    a ValueError where not even float64 holds them, or where a score mod returns NaN or +inf.
    """
    _checks.boolean(return_lse, "return_lse")
    if threads is not None:
        threads = _checks.positive_int(threads, "threads")
    p = prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, sink_logits, check_range=True)
    out, _, lse = sdpa.dispatch(p.q, p.k, p.v, backend=backend, threads=threads, attn_mask=None, dropout_p=0.0,
                                is_causal=False, scale=p.scale, enable_gqa=p.enable_gqa, rng=None,
                                return_weights=False, return_lse=return_lse, score_mod=p.score_mod,
                                block_mask=p.block_mask, sink_logits=p.sink_logits)
    if np.isnan(out).any():
        raise ValueError("query, key: the scaled scores overflowed (NaN in the output from finite inputs); "
                         "scale the inputs down or pass a smaller scale")
    out = out.reshape(p.out_shape).astype(p.dtype, copy=False)                # (…, Hq, L, Ev)
    if not return_lse:
        return out
    return out, lse.reshape(p.out_shape[:-1])                                 # (…, Hq, L)


def flex_attention_backward(grad_out, query, key, value, score_mod=None, block_mask=None, scale=None,
                            enable_gqa=False, *, sink_logits=None, backend=None, threads=None):
    """Gradients of :func:`flex_attention`: ``(grad_query, grad_key, grad_value[, grad_sink_logits])``.

    The same function as torch autograd through the dense equivalent (scores → score_mod → mask → softmax with
    the sink column → · V). The score mod's derivative comes from the mod: every built-in carries it (the
    chain rule of :func:`qkv.mods.compose` and softcap's ``1 − tanh²`` included); a custom one needs
    ``qkv.mods.ScoreMod(fn, grad=lambda score, b, h, q_idx, kv_idx: ∂fn/∂score)``, or this raises a
    ValueError before computing anything.

    Args:
        grad_out: the gradient of the loss with respect to the output, the output's shape (…, Hq, L, Ev) and
            the query's dtype.
        query, key, value, score_mod, block_mask, scale, enable_gqa, sink_logits, threads: as
            :func:`flex_attention`.
        backend: None/"auto" (:func:`qkv.backends.select`: the tiled backward when it supports the request and
            the problem has more than ``backward_whole_scores`` scores, :class:`qkv.backends.tiled.Limits`; the
            reference otherwise), "reference" or "tiled".

    Returns:
        ``(grad_query, grad_key, grad_value)`` with the shapes and dtype of query, key, value (grouped-query
        and broadcast dimensions summed, as autograd does), and ``grad_sink_logits`` (Hq,) last when
        ``sink_logits`` is given. A query that may attend to nothing passes no gradient.

    Finite inputs never give NaN: where the scores or the gradients could overflow float32
    (:func:`qkv._checks.range_check`), float16/float32 inputs are computed in float64; a ValueError where not
    even float64 holds them, or where a gradient does not fit the input dtype.
    """
    if threads is not None:
        threads = _checks.positive_int(threads, "threads")
    p = prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, sink_logits, check_range=False)
    _check_backward_mod(p)
    grad_out = _checks.float_array(grad_out, "grad_out", min_ndim=2)
    if grad_out.shape != p.out_shape:
        raise ValueError(f"grad_out: expected the output's shape {p.out_shape}, got {grad_out.shape}")
    if grad_out.dtype != p.q.dtype:
        raise TypeError(f"grad_out: expected dtype {p.q.dtype} (as query), got {grad_out.dtype}")
    if _checks.range_check(p.q, p.k, p.v, p.scale, grad_out=grad_out):      # float32 would overflow
        grad_out, p.q, p.k, p.v = (a.astype(np.float64) for a in (grad_out, p.q, p.k, p.v))
    request = dict(score_mod=p.score_mod, block_mask=p.block_mask, sink_logits=p.sink_logits)
    b, _ = backends.select(backends.Request(backend, backward=True, **request),
                           backends.Problem(p.q, p.k, p.v, p.enable_gqa))
    res = b.backward(grad_out.reshape(p.out4_shape), p.q, p.k, p.v, attn_mask=None, is_causal=False,
                     scale=p.scale, enable_gqa=p.enable_gqa, threads=threads, **request)
    grads = [res[0].reshape(p.query_shape), res[1].reshape(p.key_shape), res[2].reshape(p.value_shape)]
    if p.sink_logits is not None:
        grads.append(np.asarray(res[3]).reshape(p.sink_logits.shape))
    names = ("grad_query", "grad_key", "grad_value", "grad_sink_logits")
    for i, (name, g) in enumerate(zip(names, grads)):
        dt = p.dtype if i < 3 else p.sink_logits.dtype
        if not np.all(np.isfinite(g)) or (g.size and float(np.max(np.abs(g))) > float(np.finfo(dt).max)):
            raise ValueError(f"{name}: the gradient does not fit {dt} (it reaches "
                             f"{float(np.max(np.abs(g))):.3g}); rescale grad_out or the inputs")
        grads[i] = g.astype(dt, copy=False)
    return tuple(grads)


def _check_backward_mod(p) -> None:
    """A score mod the backward cannot differentiate is refused before anything is computed."""
    if p.score_mod is not None and not p.score_mod.has_grad:
        raise ValueError(f"score_mod: {p.score_mod.name} has no derivative, so flex_attention_backward cannot "
                         "compute its gradient; give one: qkv.mods.ScoreMod(fn, grad=lambda score, b, h, q_idx, "
                         "kv_idx: ∂fn/∂score)")


class _Prepared:
    """Validated, 4-D arguments of a flex call."""
    __slots__ = ("q", "k", "v", "dtype", "scale", "enable_gqa", "score_mod", "block_mask", "sink_logits", "query_shape",
                 "key_shape", "value_shape", "out_shape", "out4_shape")


def prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, sink_logits, *,
             check_range: bool) -> _Prepared:
    """Validate every argument (names, expected vs actual) and lift the arrays to (B, H, T, ·); with
    ``check_range``, float16/float32 arrays whose scores would overflow float32 come back as float64."""
    dtype = sdpa._input_dtype(query)
    query, key, value, _, _, scale, _ = sdpa.validate(query, key, value, None, 0.0, False, scale, enable_gqa,
                                                       False, None, check_range=check_range)
    for name, a, letters in (("query", query, "(B, Hq, L, E), (Hq, L, E) or (L, E)"),
                             ("key", key, "(B, Hk, S, E), (Hk, S, E) or (S, E)"),
                             ("value", value, "(B, Hk, S, Ev), (Hk, S, Ev) or (S, Ev)")):
        if a.ndim > 4:
            raise ValueError(f"{name}: expected shape {letters}, got {a.shape} ({a.ndim} dimensions)")
    p = _Prepared()
    p.dtype = dtype
    p.query_shape, p.key_shape, p.value_shape = query.shape, key.shape, value.shape
    p.out_shape = shapes.output_shape(query.shape, key.shape, value.shape, enable_gqa)
    p.q, p.k, p.v = (a.reshape((1,) * (4 - a.ndim) + a.shape) for a in (query, key, value))
    lead = shapes.lead(p.q.shape, p.k.shape, enable_gqa)                      # (B, Hq)
    L, S = p.q.shape[-2], p.k.shape[-2]
    p.out4_shape = lead + (L, p.v.shape[-1])
    p.scale, p.enable_gqa = scale, bool(enable_gqa)

    p.score_mod = None
    if score_mod is not None:
        if isinstance(score_mod, mods.MaskMod):
            raise TypeError("score_mod: expected (score, b, h, q_idx, kv_idx) -> score, got the mask mod "
                            f"{score_mod!r}; pass it as block_mask=qkv.create_block_mask(mask_mod, B, H, L, S)")
        p.score_mod = mods.as_score_mod(score_mod, "score_mod")
        p.score_mod.validate(lead[0], lead[1], L, S)

    p.block_mask = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            if callable(block_mask):
                raise TypeError(f"block_mask: expected a BlockMask, got the callable {_name(block_mask)}; build "
                                f"one once with qkv.create_block_mask(mask_mod, B, H, {L}, {S}) and pass that")
            raise TypeError(f"block_mask: expected a BlockMask from qkv.create_block_mask, got "
                            f"{type(block_mask).__name__}")
        block_mask.check_sizes(lead, L, S, "block_mask")
        p.block_mask = block_mask

    p.sink_logits = None
    if sink_logits is not None:
        sl = _checks.float_array(sink_logits, "sink_logits")
        if float(np.abs(sl).max(initial=0.0)) > 1e30:          # 1e39 (finite in float64) is inf in float32
            raise ValueError(f"sink_logits: expected logits within ±1e30, got {float(np.abs(sl).max()):.6g}")
        if sl.shape != (lead[-1],):
            raise ValueError(f"sink_logits: expected shape ({lead[-1]},) (one logit per query head), got "
                             f"{sl.shape}")
        p.sink_logits = sl
    return p


def _name(fn) -> str:
    return repr(fn) if isinstance(fn, mods.MaskMod) else getattr(fn, "__name__", type(fn).__name__)
