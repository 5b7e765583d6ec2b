"""qkv on torch tensors: :func:`flex_attention` and :func:`scaled_dot_product_attention`, differentiable.

Drop-ins for ``torch.nn.attention.flex_attention.flex_attention`` and
``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, computed by qkv's own forward and
backward (the tiled engine: memory linear in the sequence, empty blocks of a block mask skipped) inside a
``torch.autograd.Function`` — never a dense fallback, except for SDPA's dropout and learnable float masks
(below)::

    import torch, qkv.torch
    from torch.nn.attention.flex_attention import create_block_mask

    bias = torch.zeros(8, 2 * 1024, requires_grad=True)                  # learnable, per head and offset
    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 1024]
    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)
    bm = create_block_mask(window, None, None, 1024, 1024, device="cpu")
    out = qkv.torch.flex_attention(q, k, v, rel_bias, bm)                # (B, H, L, Ev)
    out.sum().backward()                                                  # q.grad, k.grad, v.grad, bias.grad

**Mods** written with torch operations work unchanged: qkv calls them with torch tensors, a block at a time
(``score`` (…, Lb, Sb), ``q_idx`` (Lb, 1), ``kv_idx`` (1, Sb), ``b``/``h`` shaped to broadcast — torch's vmap
calls them with scalars, so a mod must broadcast, as operators, ``torch.where`` and indexing do). Tensors a
score mod captures with ``requires_grad`` (closure cells, globals, an ``nn.Module``'s parameters) get their
gradients, through torch autograd on each block's mod (:mod:`qkv.integrations._torch_mods`). A :class:`qkv.mods.ScoreMod`
(``qkv.mods.alibi`` …) runs as it is, on NumPy. **Block masks**: torch's ``BlockMask`` (its block structure is
read, its ``mask_mod`` called with torch tensors on the partial blocks) or qkv's (:func:`qkv.create_block_mask`).

**Dtypes**: float32 and float64 computed as they are; float16 and bfloat16 computed in float32 and returned in
their dtype. Tensors on another device than the CPU are refused (use torch's own functions there).

Differences from torch, on purpose: a query row that may attend to nothing gives output 0 (torch's SDPA: NaN);
SDPA's dropout draws its mask from NumPy's generator seeded from torch's (``torch.manual_seed`` makes it
reproducible, but it is not torch's mask); dropout, and a float ``attn_mask`` that requires a gradient,
materialize the (B, H, L, S) weights to differentiate them.

Shape legend: B batch, Hq query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width.
Mask convention: True = may attend (torch's SDPA and flex alike).
"""
from __future__ import annotations

import types

import numpy as np

from qkv import _checks
from qkv.engine import backends
from qkv.core import mods, shapes
from qkv.engine import flex as _flex, sdpa as _sdpa
from qkv._extras import need
from qkv.core.blockmask import BlockMask

torch = need("torch", "qkv.torch")                   # an ImportError naming the extra when torch is missing
from qkv.integrations import _torch_mods  # noqa: E402  (imports torch)

__all__ = ["flex_attention", "scaled_dot_product_attention"]

_DTYPES = types.MappingProxyType({torch.float16: np.float32, torch.bfloat16: np.float32, torch.float32: np.float32,
           torch.float64: np.float64})


# ============================================================================================== tensors
def _check_tensor(t, name: str, instead: str, dtype=None) -> None:
    """TypeError/ValueError naming ``name`` unless ``t`` is a floating CPU tensor (of ``dtype`` when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: qkv.torch computes on the CPU, got a tensor on {t.device}; use {instead} there")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (as query), got {t.dtype}")


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a NumPy array in its compute dtype (float16/bfloat16 → float32; otherwise no copy)."""
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.resolve_conj().resolve_neg().numpy()


def _tensor(a: np.ndarray, dtype) -> torch.Tensor:
    """A NumPy result as a torch tensor of ``dtype`` (no copy where the dtypes agree)."""
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a).to(dtype)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ======================================================================================= flex_attention
class _FlexCall:
    """What one :func:`flex_attention` call computes, beside its tensors: the score mod (a torch mod and the
    tensors it captures, or a :class:`qkv.mods.ScoreMod`), qkv's block mask, scale, enable_gqa."""

    def __init__(self, score_mod, block_mask, scale, enable_gqa, L: int, S: int, sinks: bool = False):
        self.fn, self.torch_mod, self.captured = score_mod, False, []
        if score_mod is not None and not isinstance(score_mod, mods.ScoreMod):
            if isinstance(score_mod, mods.MaskMod) or not callable(score_mod):
                raise TypeError(f"score_mod: expected (score, b, h, q_idx, kv_idx) -> score, got "
                                f"{type(score_mod).__name__}; pass a mask mod as "
                                "block_mask=create_block_mask(mask_mod, B, H, L, S)")
            self.torch_mod, self.captured = True, _torch_mods.captured_tensors(score_mod)
        self.block_mask = _block_mask(block_mask, L, S)
        self.scale, self.enable_gqa = scale, enable_gqa
        self.accumulator = None
        # torch's causal BlockMask alone (proven i ≥ j on its grid): SDPA's is_causal, on the plain causal loops
        self.is_causal = score_mod is None and not sinks and _torch_mods.is_causal(self.block_mask)

    def forward_mod(self):
        return _torch_mods.score_mod(self.fn, self.captured) if self.torch_mod else self.fn

    def backward_mod(self):
        """The mod the backward runs: a torch mod with a vjp that collects its captured tensors' gradients."""
        if not self.torch_mod:
            return self.fn
        self.accumulator = _torch_mods.Accumulator(self.captured)
        return _torch_mods.score_mod(self.fn, self.captured, self.accumulator)


def _block_mask(block_mask, L: int, S: int):
    """qkv's :class:`BlockMask` for torch's or qkv's (None stays None)."""
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    if isinstance(block_mask, TorchBlockMask):
        return _torch_mods.block_mask_from_torch(block_mask, L, S)
    raise TypeError(f"block_mask: expected a BlockMask (torch's create_block_mask or qkv.create_block_mask), got "
                    f"{type(block_mask).__name__}")


class _Flex(torch.autograd.Function):
    """qkv's flex forward and backward as one autograd node: inputs (call, q, k, v, sinks, *captured)."""

    @staticmethod
    def forward(ctx, call: _FlexCall, query, key, value, sink_logits, *captured):
        q, k, v = _numpy(query), _numpy(key), _numpy(value)
        sinks = None if sink_logits is None else _numpy(sink_logits)
        if call.is_causal:
            out, lse = _sdpa.scaled_dot_product_attention(q, k, v, None, 0.0, True, call.scale, call.enable_gqa,
                                                          return_lse=True)
        else:
            out, lse = _flex.flex_attention(q, k, v, call.forward_mod(), call.block_mask, call.scale,
                                            call.enable_gqa, return_lse=True, sink_logits=sinks)
        ctx.call, ctx.out, ctx.lse = call, out, lse
        ctx.save_for_backward(query, key, value, sink_logits)
        ctx.set_materialize_grads(False)
        return _tensor(out, query.dtype), _tensor(lse, _lse_dtype(query.dtype))

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        call = ctx.call
        query, key, value, sink_logits = ctx.saved_tensors
        n_captured = len(call.captured)
        if grad_out is None and grad_lse is None:
            return (None,) * (5 + n_captured)
        sinks = None if sink_logits is None else _numpy(sink_logits)
        mod = call.backward_mod()
        p = _flex.prepare(_numpy(query), _numpy(key), _numpy(value), mod, call.block_mask, call.scale,
                           call.enable_gqa, sinks, check_range=False)
        cdt = ctx.lse.dtype                                                  # float64 where the forward widened
        q, k, v = (a.astype(cdt, copy=False) for a in (p.q, p.k, p.v))
        out = ctx.out.reshape(p.out4_shape).astype(cdt, copy=False)          # (B, Hq, L, Ev)
        lse = ctx.lse.reshape(p.out4_shape[:-1])                             # (B, Hq, L)
        do = (np.zeros(p.out4_shape, cdt) if grad_out is None
              else _numpy(grad_out).reshape(p.out4_shape).astype(cdt, copy=False))
        Ev = v.shape[-1]
        if grad_lse is not None:
            do, v, out = _with_lse_column(do, v, out, _numpy(grad_lse).reshape(lse.shape).astype(cdt))
        # named: the tiled backward takes the forward's out and lse (and a torch mod's vjp collects its tensors)
        b, _ = backends.select(backends.Request("tiled", backward=True, score_mod=mod, sink_logits=p.sink_logits))
        res = b.backward(do, q, k, v, attn_mask=None, is_causal=call.is_causal, scale=p.scale,
                         enable_gqa=p.enable_gqa, score_mod=mod, block_mask=None if call.is_causal else p.block_mask,
                         sink_logits=p.sink_logits, out=out, lse=lse)
        dq = res[0].reshape(p.query_shape)
        dk = res[1].reshape(p.key_shape)
        dv = res[2][..., :Ev].reshape(p.value_shape)
        grads = [_tensor(dq, query.dtype), _tensor(dk, key.dtype), _tensor(dv, value.dtype)]
        grads.append(None if sink_logits is None else _tensor(res[3], sink_logits.dtype))
        captured = call.accumulator.result() if call.accumulator is not None else [None] * n_captured
        return (None, *grads, *captured)


def _with_lse_column(do, v, out, grad_lse):
    """The lse's gradient folded into the backward's ``D = rowsum(dO ∘ O)``: ``∂lse_i/∂s'_ij = P_ij``, so it adds
    ``P_ij·grad_lse_i`` to ``dS'_ij = P_ij·(dP_ij − D_i)`` — which is ``D_i − grad_lse_i`` in place of ``D_i``. A
    value column of zeros (dP unchanged) with ``dO`` 1 and ``O`` −grad_lse there does exactly that (and the sinks'
    ``−Σ P_sink·D`` gains ``Σ P_sink·grad_lse``, the lse's share). The extra column of dV is dropped."""
    do = np.concatenate([do, np.ones(do.shape[:-1] + (1,), do.dtype)], axis=-1)        # (B, Hq, L, Ev+1)
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (1,), v.dtype)], axis=-1)            # (B, Hk, S, Ev+1)
    out = np.concatenate([out, -grad_lse[..., None]], axis=-1)                          # (B, Hq, L, Ev+1)
    return do, v, out


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, sink_logits=None):
    """torch's ``flex_attention`` on qkv's engine: ``softmax(score_mod(Q·Kᵀ·scale) masked by block_mask [, sinks])
    · V``, differentiable in query, key, value, sink_logits and the tensors ``score_mod`` captures.

    Args:
        query: (B, Hq, L, E) CPU tensor (or (Hq, L, E), (L, E)), float16/bfloat16/float32/float64.
        key: (B, Hk, S, E), the same dtype. value: (B, Hk, S, Ev), the same dtype.
        score_mod: None; ``score_mod(score, b, h, q_idx, kv_idx) -> score`` written with torch operations
            (called with torch tensors that broadcast over a block); or a :class:`qkv.mods.ScoreMod`.
        block_mask: None (every key visible), torch's ``BlockMask`` (``create_block_mask(..., device="cpu")``)
            or qkv's :class:`qkv.BlockMask`, built for (B or None, Hq or None, L, S).
        scale: multiplier of the scores; None means 1/√E.
        enable_gqa: Hk may divide Hq (grouped-query).
        return_lse: also return the log-sum-exp of each row, (B, Hq, L) float32 (float64 for float64
            inputs), differentiable.
        kernel_options: accepted for torch's signature and ignored (they tune torch's compiled kernels).
        sink_logits: None, or (Hq,) learned attention sinks (gpt-oss): each row's softmax denominator gains
            ``exp(sink_logits[h])``.

    Returns:
        output (B, Hq, L, Ev) in the query's dtype; ``(output, lse)`` with ``return_lse``. A query that may
        attend to nothing gets 0 (lse −inf).

    Raises:
        TypeError / ValueError naming the argument, expected vs actual; a tensor not on the CPU is refused
        (use torch's ``flex_attention`` there).
    """
    _checks.boolean(return_lse, "return_lse")
    instead = "torch.nn.attention.flex_attention.flex_attention"
    _check_tensor(query, "query", instead)
    _check_tensor(key, "key", instead, query.dtype)
    _check_tensor(value, "value", instead, query.dtype)
    if sink_logits is not None:
        _check_tensor(sink_logits, "sink_logits", instead)
    if query.ndim < 2 or key.ndim < 2:
        raise ValueError(f"query, key: expected at least 2 dimensions (…, L, E), got shapes {tuple(query.shape)}, "
                         f"{tuple(key.shape)}")
    call = _FlexCall(score_mod, block_mask, scale, enable_gqa, query.shape[-2], key.shape[-2],
                     sinks=sink_logits is not None)
    out, lse = _Flex.apply(call, query, key, value, sink_logits, *call.captured)
    return (out, lse) if return_lse else out


# ==================================================================================== scaled_dot_product
class _SDPACall:
    """The options of one :func:`scaled_dot_product_attention` call."""

    def __init__(self, dropout_p, is_causal, scale, enable_gqa, mask_grad: bool):
        self.dropout_p, self.is_causal, self.scale, self.enable_gqa = dropout_p, is_causal, scale, enable_gqa
        self.dense = dropout_p > 0 or mask_grad              # the weights materialized (see _dense_backward)
        self.seed = None
        if dropout_p > 0:                                    # one draw from torch's generator per call
            self.seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())

    def run(self, q, k, v, mask, *, dropout: bool, **kw):
        rng = np.random.default_rng(self.seed) if dropout else None
        return _sdpa.scaled_dot_product_attention(q, k, v, mask, self.dropout_p if dropout else 0.0,
                                                  self.is_causal, self.scale, self.enable_gqa, rng=rng, **kw)


class _SDPA(torch.autograd.Function):
    """qkv's SDPA forward and backward as one autograd node: inputs (call, q, k, v, attn_mask)."""

    @staticmethod
    def forward(ctx, call: _SDPACall, query, key, value, attn_mask):
        q, k, v = _numpy(query), _numpy(key), _numpy(value)
        mask = None if attn_mask is None else _mask_numpy(attn_mask)
        if call.dense:
            out, ctx.weights = call.run(q, k, v, mask, dropout=call.dropout_p > 0, return_weights=True)
        else:
            out, ctx.lse = call.run(q, k, v, mask, dropout=False, return_lse=True)
        ctx.call, ctx.out = call, out
        ctx.save_for_backward(query, key, value, attn_mask)
        return _tensor(out, query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        call = ctx.call
        query, key, value, attn_mask = ctx.saved_tensors
        q, k, v = _numpy(query), _numpy(key), _numpy(value)
        mask = None if attn_mask is None else _mask_numpy(attn_mask)
        do = _numpy(grad_out).astype(ctx.out.dtype, copy=False)
        grad_mask = None
        if call.dense:
            *grads, ds = _dense_backward(call, do, q, k, v, mask, ctx.weights)
            if ctx.needs_input_grad[4]:                      # a float mask is added to the scores: dS is its grad
                grad_mask = _tensor(shapes.sum_to_shape(ds, tuple(attn_mask.shape)), attn_mask.dtype)
        else:
            grads = _sdpa_backward(call, do, q, k, v, mask, ctx.out, ctx.lse)
        return (None, *(_tensor(g, t.dtype) for g, t in zip(grads, (query, key, value))), grad_mask)


def _mask_numpy(mask: torch.Tensor) -> np.ndarray:
    return mask.detach().numpy() if mask.dtype == torch.bool else _numpy(mask)


def _sdpa_backward(call, do, q, k, v, mask, out, lse) -> tuple:
    """``(dq, dk, dv)`` by qkv's backward, from the forward's output and lse (not recomputed); the backend as
    :func:`qkv.backends.select` chooses it (whole arrays up to ``backward_whole_scores`` scores, tiled beyond)."""
    q, k, v, mask, _, scale, _ = _sdpa.validate(q, k, v, mask, 0.0, call.is_causal, call.scale, call.enable_gqa,
                                                 False, None, check_range=False)
    dt = q.dtype
    if lse.dtype != q.dtype:                                  # the forward widened to float64: so does this
        q, k, v = (a.astype(lse.dtype) for a in (q, k, v))
    do = do.astype(q.dtype, copy=False)
    b, _ = backends.select(backends.Request(backward=True), backends.Problem(q, k, v, call.enable_gqa))
    saved = {} if backends.name_of(b) == "reference" else dict(out=out.astype(q.dtype, copy=False), lse=lse)
    grads = b.backward(do, q, k, v, attn_mask=mask, is_causal=call.is_causal, scale=scale,
                       enable_gqa=call.enable_gqa, **saved)
    return tuple(g.astype(dt, copy=False) for g in grads)


def _dense_backward(call, do, q, k, v, mask, w) -> tuple:
    """``(dq, dk, dv, dS)`` on whole arrays, for dropout or a float mask that takes a gradient: ``O = W·V`` with
    ``W = P ∘ keep/(1 − p)`` the (dropped) weights the forward returned, ``P`` the weights without dropout (computed
    again; ``W`` itself without dropout). ``dV = Wᵀ·dO``, ``dW = dO·Vᵀ``; ``dP = dW ∘ keep/(1 − p)``, so
    ``P ∘ dP = W ∘ dW`` and the softmax's backward ``dS = P ∘ (dP − rowsum(P ∘ dP))`` is
    ``W ∘ dW − P ∘ rowsum(W ∘ dW)`` — the float mask's gradient, as it is added to the scores;
    ``dQ = dS·K·scale``, ``dK = dSᵀ·Q·scale``."""
    p = w if call.dropout_p == 0 else call.run(q, k, v, mask, dropout=False, return_weights=True)[1]
    cdt = np.result_type(w.dtype, np.float32)
    w, p, do = w.astype(cdt, copy=False), p.astype(cdt, copy=False), do.astype(cdt, copy=False)
    rep = shapes.n_rep(q.shape, k.shape, call.enable_gqa)
    ke, ve = (np.repeat(a.astype(cdt, copy=False), rep, axis=-3) for a in (k, v))   # (…, Hq, S, ·)
    scale = call.scale if call.scale is not None else 1.0 / np.sqrt(q.shape[-1])
    dv = np.swapaxes(w, -1, -2) @ do                                          # (…, Hq, S, Ev)
    dw = do @ np.swapaxes(ve, -1, -2)                                         # (…, Hq, L, S)
    x = w * dw
    ds = x - p * x.sum(axis=-1, keepdims=True)
    dq = (ds @ ke) * scale                                                    # (…, Hq, L, E)
    dk = (np.swapaxes(ds, -1, -2) @ q.astype(cdt, copy=False)) * scale        # (…, Hq, S, E)
    if rep > 1:                                                               # a kv head sums its query heads
        dk = dk.reshape(dk.shape[:-3] + (dk.shape[-3] // rep, rep) + dk.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(dv.shape[:-3] + (dv.shape[-3] // rep, rep) + dv.shape[-2:]).sum(axis=-3)
    return (shapes.sum_to_shape(dq, q.shape), shapes.sum_to_shape(dk, k.shape), shapes.sum_to_shape(dv, v.shape),
            ds)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch's ``scaled_dot_product_attention`` on qkv's engine, differentiable in query, key and value.

    Args:
        query: (…, Hq, L, E) CPU tensor, float16/bfloat16/float32/float64.
        key: (…, Hk, S, E), value (…, Hk, S, Ev): the same dtype; leading dims broadcast.
        attn_mask: None; a bool tensor broadcastable to (…, Hq, L, S), **True = may attend** (as torch's SDPA);
            or a float tensor added to the scaled scores — differentiable: one that requires a gradient gets it,
            computed on the (…, L, S) weights, as the mask itself is that size.
        dropout_p: probability of dropping each weight (inverted dropout; always applied when > 0, as torch's
            functional SDPA). The mask comes from NumPy's generator seeded by one draw from torch's, so
            ``torch.manual_seed`` reproduces it; the (…, L, S) weights are materialized to differentiate it.
        is_causal: top-left causal mask (query i sees keys 0 … i). Not with ``attn_mask``.
        scale: multiplier of the scores; None means 1/√E.
        enable_gqa: Hk may divide Hq (grouped-query).

    Returns:
        (…, Hq, L, Ev) in the query's dtype. A row that may attend to nothing gives 0 (torch: NaN).

    Raises:
        TypeError / ValueError naming the argument, expected vs actual; a tensor not on the CPU is refused
        (use ``torch.nn.functional.scaled_dot_product_attention`` there).
    """
    instead = "torch.nn.functional.scaled_dot_product_attention"
    _check_tensor(query, "query", instead)
    _check_tensor(key, "key", instead, query.dtype)
    _check_tensor(value, "value", instead, query.dtype)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool:
            _check_tensor(attn_mask, "attn_mask", instead)
        elif attn_mask.device.type != "cpu":
            raise ValueError(f"attn_mask: qkv.torch computes on the CPU, got a tensor on {attn_mask.device}; "
                             f"use {instead} there")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1], got {dropout_p!r}")
    mask_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
    call = _SDPACall(float(dropout_p), _checks.boolean(is_causal, "is_causal"), scale, enable_gqa, mask_grad)
    return _SDPA.apply(call, query, key, value, attn_mask)
