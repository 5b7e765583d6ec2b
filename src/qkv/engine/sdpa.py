"""Scaled dot-product attention: validation at the boundary, then a backend from the registry."""
from __future__ import annotations

import math
import numbers

import numpy as np

from qkv import _checks
from qkv.engine import backends
from qkv.core import pipeline, shapes, stages
from qkv.core.tracing import Trace, maybe


def _is_torch_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_weights, rng, *,
              check_range=True, known=None):
    """The checked arguments ``(query, key, value, attn_mask, dropout_p, scale, rng)``, or a TypeError or
    ValueError naming the bad one.

    Finite inputs whose scores (or the tiled engine's running sums) would overflow the compute dtype
    (:func:`qkv._checks.range_check`): float16/float32 query, key and value come back as float64, so the
    call computes in float64 (the caller casts its result back to the input dtype; ``_input_dtype``);
    beyond float64 a ValueError. ``check_range=False`` leaves that to the caller (the backward, which bounds
    its gradients too, and ``attention_weights``, which bounds only its rows). ``known``: max |x| of the
    inputs the caller has read as it made them (finite), by name ("query", "key", "value"): not read again.
    """
    extents = dict(known or {})                        # max |x| per input, read with its finiteness
    query = _checks.float_array(query, "query", min_ndim=2, extents=extents)
    key = _checks.float_array(key, "key", min_ndim=2, extents=extents)
    value = _checks.float_array(value, "value", min_ndim=2, extents=extents)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key, value: expected one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    for name, a in (("query", query), ("key", key), ("value", value)):
        if 0 in a.shape:
            raise ValueError(f"{name}: expected no empty dimension, got shape {a.shape}")
    L, E = query.shape[-2:]
    S, Ek = key.shape[-2:]
    if Ek != E:
        raise ValueError(f"key: expected last dimension E={E} (the query's width), got {Ek} "
                         f"(query {query.shape}, key {key.shape})")
    if value.shape[-2] != S:
        raise ValueError(f"value: expected {S} rows (one per key), got {value.shape[-2]} "
                         f"(key {key.shape}, value {value.shape})")
    if key.shape[:-2] != value.shape[:-2]:
        raise ValueError(f"value: expected leading dimensions {key.shape[:-2]} (as key), got {value.shape[:-2]}")
    _checks.boolean(is_causal, "is_causal")
    _checks.boolean(enable_gqa, "enable_gqa")
    _checks.boolean(return_weights, "return_weights")
    if enable_gqa:
        if query.ndim < 3 or key.ndim < 3:
            raise ValueError(f"enable_gqa: expected query and key of shape (..., heads, seq, dim), got "
                             f"{query.shape} and {key.shape}")
        Hq, Hk = query.shape[-3], key.shape[-3]
        if Hq % Hk:
            raise ValueError(f"enable_gqa: the number of query heads ({Hq}) must be a multiple of the number "
                             f"of key/value heads ({Hk})")
    try:
        lead = shapes.lead(query.shape, key.shape, enable_gqa)
    except ValueError:
        hint = "" if enable_gqa or query.ndim < 3 or key.ndim < 3 or query.shape[-3] == key.shape[-3] \
            else "; pass enable_gqa=True to share key/value heads among query heads"
        raise ValueError(f"key: leading dimensions {key.shape[:-2]} do not broadcast with the query's "
                         f"{query.shape[:-2]}{hint}") from None
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask: expected None when is_causal=True (as in torch); combine the causal "
                             "mask into attn_mask with qkv.masks.combine(qkv.masks.causal(L, S), mask) instead")
        attn_mask = _checks.mask_array(attn_mask, "attn_mask", _checks.compute_dtype(query.dtype))
        _checks.broadcastable(attn_mask.shape, tuple(lead) + (L, S), "attn_mask", "the scores' shape")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1], got {dropout_p!r}")
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator or None, got {type(rng).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number or None (= 1/√E = {1 / math.sqrt(E):.6g}), "
                         f"got {scale!r}")
    if dropout_p > 0 and rng is None:
        rng = np.random.default_rng()
    if check_range and _checks.range_check(query, key, value, scale, extents=extents):
        query, key, value = (a.astype(np.float64) for a in (query, key, value))
    return query, key, value, attn_mask, float(dropout_p), float(scale), rng


def _input_dtype(x) -> np.dtype:
    """The dtype :func:`validate` gives ``x`` before any widening: an array's own, float64 for lists."""
    return x.dtype if isinstance(x, np.ndarray) else np.dtype(np.float64)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, return_weights=False, rng=None,
                                 backend=None, trace: Trace | None = None, return_lse=False, threads=None):
    """Attention ``softmax(Q·Kᵀ · scale + mask) · V``, the semantics of torch's SDPA.

    Args:
        query: (..., Hq, L, E) float16/32/64.
        key: (..., Hk, S, E), same dtype; leading dims broadcast with the query's.
        value: (..., Hk, S, Ev), same dtype.
        attn_mask: None; bool broadcastable to (..., Hq, L, S), **True = may attend**; or float, added to the
            scaled scores. Not allowed together with ``is_causal``.
        dropout_p: probability of dropping each attention weight (inverted dropout), drawn from ``rng``.
        is_causal: top-left causal mask, query i sees keys 0..i (see :func:`qkv.masks.causal`).
        scale: multiplier of the scores; None means 1/√E.
        enable_gqa: Hk may divide Hq; key/value head h serves query heads h·Hq/Hk … (h+1)·Hq/Hk − 1.
        return_weights: also return the attention weights (..., Hq, L, S) (after dropout, if any).
        rng: a ``numpy.random.Generator`` for dropout (a fresh one when None).
        backend: None/"auto" chooses by size (:func:`qkv.backends.select`: the reference for small inputs, the
            tiled engine when the (…, L, S) scores would be large); or a name from :func:`qkv.backends.names`:
            "reference", "tiled", "torch".
        trace: a :class:`qkv.Trace` to record the stages into (forces the observable reference path; another
            explicit backend together with a trace is a ValueError).
        return_lse: also return the log-sum-exp of each row of the masked, scaled scores, (..., Hq, L), in the
            compute dtype (float32 for float16 inputs; float64 where the scores would overflow float32, see
            below); −inf for a row that may attend to nothing.
        threads: worker threads of the tiled engine for this call (default :func:`qkv.get_num_threads`);
            the reference and torch backends ignore it.

    Returns:
        output (..., Hq, L, Ev) in the input dtype; ``(output, weights)`` when ``return_weights``,
        ``(output, lse)`` when ``return_lse``, ``(output, weights, lse)`` with both.

    Torch tensors in (any device) run on torch's SDPA with these semantics and come back as torch tensors.

    Differences from torch, on purpose: a query row that may attend to nothing returns zeros (and zero
    weights) where torch returns NaN; float16 is computed in float32. Finite inputs never give NaN: where
    the scores q·k·scale could overflow float32 (max ‖q‖·max ‖k‖·|scale| beyond 1e37, by Cauchy–Schwarz), or
    the tiled engine's running sums of p·v (S·e^40·max |v|), float16 and float32 inputs are computed in
    float64 and the output returned in their dtype; beyond float64's range (1e300) a ValueError says what
    overflows. (NumPy inputs; torch tensors are torch's.)
    """
    _checks.boolean(return_lse, "return_lse")
    if threads is not None:
        threads = _checks.positive_int(threads, "threads")
    if _is_torch_tensor(query):
        b, _ = backends.select(backends.Request(backend, torch_tensors=True))
        attn_mask, scale = _validate_torch(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                           enable_gqa, return_weights, rng)
        res = backends.forward(b, query, key, value, attn_mask=attn_mask,
                               dropout_p=float(dropout_p), is_causal=is_causal, scale=scale,
                               enable_gqa=enable_gqa, rng=rng, return_weights=return_weights,
                               return_lse=return_lse)
        return _pack(res, return_weights, return_lse)
    return _numpy_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_weights,
                       rng, backend, trace, return_lse, threads)


def _numpy_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_weights, rng,
                backend, trace, return_lse, threads, known=None):
    """:func:`scaled_dot_product_attention` on NumPy inputs: checked (``known`` as :func:`validate`'s), run
    on the chosen backend, widened results cast back, packed as asked."""
    dt = _input_dtype(query)
    query, key, value, attn_mask, dropout_p, scale, rng = validate(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_weights, rng, known=known)
    res = dispatch(query, key, value, backend=backend, trace=trace, attn_mask=attn_mask, dropout_p=dropout_p,
                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, rng=rng,
                   return_weights=return_weights, return_lse=return_lse, threads=threads)
    if query.dtype != dt:                                # widened to float64 (scores beyond float32): back
        res = (res[0].astype(dt), None if res[1] is None else res[1].astype(dt)) + tuple(res[2:])
    return _pack(res, return_weights, return_lse)


def attention_with_extents(query, key, value, extents: dict, attn_mask=None, is_causal=False, enable_gqa=False):
    """:func:`scaled_dot_product_attention` (NumPy arrays, default scale, no dropout) for a caller inside qkv
    that read its inputs' extents as it made them: ``extents`` max |x| of "query", "key" and "value", each
    finite (the decoders' row-wise steps read them per row block, on every worker, where the checks' max and
    min passes over the three arrays ran on one thread, 0.2–0.45 ms a call of SmolLM2's prefill, while the
    others waited). The same checks otherwise, the same path."""
    return _numpy_sdpa(query, key, value, attn_mask, 0.0, is_causal, None, enable_gqa, False, None, None, None,
                       False, None, known=extents)


def dispatch(query, key, value, *, backend=None, trace: Trace | None = None, threads=None, **kw):
    """Run validated arrays on the backend :func:`qkv.backends.select` chooses (recording into ``trace``, which
    keeps the choice and its reason: ``trace.backends``): ``(out, weights, lse)``.

    For :func:`scaled_dot_product_attention` and :func:`qkv.flex_attention`; ``kw`` are the backend's forward
    arguments (see :mod:`qkv.backends.base`).
    """
    with maybe(trace) as active:
        b, reason = backends.select(backends.Request.of(backend, traced=active is not None, **kw),
                                    backends.Problem(query, key, value, kw.get("enable_gqa")))
        if active is not None:
            if len(active) == 0:                         # called directly: its inputs are Q, K, V
                stages.observe_input("Q", query)
                stages.observe_input("K", key)
                stages.observe_input("V", value)
            active.chose(backends.name_of(b), reason)
        return backends.forward(b, query, key, value, threads=threads, **kw)


def _pack(res, return_weights: bool, return_lse: bool):
    """A backend's ``(out, weights, lse)`` as the caller asked for it."""
    out, weights = res[0], res[1]
    if return_lse:
        return (out, weights, res[2]) if return_weights else (out, res[2])
    return (out, weights) if return_weights else out


def _validate_torch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_weights,
                    rng):
    """The checks of :func:`validate` for torch tensors, run on zero-stride NumPy stand-ins of their shapes."""
    import torch

    names = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
             torch.bfloat16: np.float32, torch.bool: np.bool_}

    def standin(t, name):
        if not _is_torch_tensor(t):
            raise TypeError(f"{name}: expected a torch tensor like query, got {type(t).__name__}")
        if t.dtype not in names:
            raise TypeError(f"{name}: expected a floating torch tensor, got dtype {t.dtype}")
        return np.broadcast_to(np.zeros((), names[t.dtype]), tuple(t.shape))

    q, k, v = standin(query, "query"), standin(key, "key"), standin(value, "value")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key, value: expected one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if q.dtype == np.bool_:
        raise TypeError("query: expected a floating torch tensor, got dtype torch.bool")
    m = None
    if attn_mask is not None:
        m = standin(attn_mask, "attn_mask") if _is_torch_tensor(attn_mask) else attn_mask
    _, _, _, _, _, scale, _ = validate(q, k, v, m, dropout_p, is_causal, scale, enable_gqa, return_weights,
                                        None, check_range=False)             # zeros: nothing to bound
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator or None, got {type(rng).__name__}")
    return attn_mask, scale


#: ``backend="auto"``'s size rule lives with the tiled engine (it is the engine's to say when it pays).
choose_auto = backends.choose_auto


def attention(x, w_q, w_k, w_v, *, x_kv=None, attn_mask=None, is_causal=False, scale=None,
              trace: Trace | None = None):
    """Single-head attention from token vectors, the seeds' hand calculation end to end.

    ``Q = X·W_Q``, ``K = X_kv·W_K``, ``V = X_kv·W_V``, then :func:`scaled_dot_product_attention`.

    Args:
        x: (..., L, D) query-side token vectors (one row per token).
        w_q, w_k: (D, E) and (D_kv, E) projections; w_v: (D_kv, Ev).
        x_kv: (..., S, D_kv) key/value-side vectors for cross-attention; None means ``x`` (self-attention).
        attn_mask, is_causal, scale: as in :func:`scaled_dot_product_attention` (True = may attend).
        trace: a :class:`qkv.Trace` to record every stage into.

    Returns:
        ``(output, weights)``: (..., L, Ev) and (..., L, S).
    """
    x = _checks.float_array(x, "x", min_ndim=2)
    x_kv_arr = x if x_kv is None else _checks.float_array(x_kv, "x_kv", min_ndim=2)
    w_q = _checks.float_array(w_q, "w_q", ndim=2)
    w_k = _checks.float_array(w_k, "w_k", ndim=2)
    w_v = _checks.float_array(w_v, "w_v", ndim=2)
    if w_q.shape[0] != x.shape[-1]:
        raise ValueError(f"w_q: expected {x.shape[-1]} rows (the width of x), got shape {w_q.shape}")
    kv_name = "x" if x_kv is None else "x_kv"
    for name, w in (("w_k", w_k), ("w_v", w_v)):
        if w.shape[0] != x_kv_arr.shape[-1]:
            raise ValueError(f"{name}: expected {x_kv_arr.shape[-1]} rows (the width of {kv_name}), "
                             f"got shape {w.shape}")
    if w_k.shape[1] != w_q.shape[1]:
        raise ValueError(f"w_k: expected {w_q.shape[1]} columns (as w_q: queries and keys share a width), "
                         f"got shape {w_k.shape}")
    dtype = np.result_type(x, x_kv_arr, w_q, w_k, w_v)
    src = "x" if x_kv is None else "x_kv"

    def attend(q, k, v, rows):
        for a, what in ((q, "x, w_q: Q = x · w_q"), (k, f"{src}, w_k: K = {src} · w_k"),
                        (v, f"{src}, w_v: V = {src} · w_v")):
            if not np.all(np.isfinite(a)):                     # finite inputs whose product is not: name them
                raise ValueError(f"{what} overflowed {np.dtype(dtype)} (got {a[~np.isfinite(a)].flat[0]}); "
                                 "expected inputs whose products stay finite — scale them down")
        with np.errstate(over="warn", invalid="warn"):        # numpy's defaults again past the projections
            return scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                                return_weights=True, backend="reference")

    with maybe(trace), np.errstate(over="ignore", invalid="ignore"):               # an overflow is named above
        return pipeline.layer(x.astype(dtype, copy=False), w_q.astype(dtype, copy=False),
                              w_k.astype(dtype, copy=False), w_v.astype(dtype, copy=False),
                              x_kv=None if x_kv is None else x_kv_arr.astype(dtype, copy=False), attend=attend)
