"""qkv's attention function for transformers (``AttentionInterface``): every attention layer of a model on qkv.

transformers calls ``fn(module, query, key, value, attention_mask, scaling=…, dropout=…, **kwargs)`` with the
layer's queries and keys after the positions (RoPE), ``query (B, Hq, L, E)``, ``key (B, Hk, S, E)``,
``value (B, Hk, S, Ev)``, and expects ``(attn_output (B, L, Hq, Ev), attn_weights (B, Hq, L, S) or None)`` —
the layout sdpa's integration returns. The ``attention_mask`` is what :func:`qkv.hf._mask.mask_function` built:
a :class:`~qkv.hf._mask.Mask` holding the qkv block mask (or None, or a 4-D tensor a caller passed itself).

What runs:

- **with gradients** (training, fine-tuning): ``qkv.torch.flex_attention`` — autograd through qkv's own
  backward; with dropout (training, ``dropout > 0``), ``qkv.torch.scaled_dot_product_attention`` on the mask's
  booleans;
- **without** (``torch.no_grad()``, inference, ``generate``): :func:`qkv.flex_attention` on NumPy views of the
  tensors, no autograd bookkeeping at all.

The keywords transformers passes: ``softcap`` (Gemma 2's logit soft-capping → :func:`qkv.mods.softcap`),
``s_aux`` (gpt-oss's learned sinks (Hq,) → ``sink_logits``), ``output_attentions`` (the weights are returned,
computed by qkv's stages: a fully masked query row — a left-padding position — gets zeros where eager spreads
it evenly over the keys), ``is_causal`` (with no mask), and the rest (position ids, cache flags) are not needed.
"""
from __future__ import annotations

import numpy as np

from qkv.core import mods, stages
from qkv.engine.flex import flex_attention as _np_flex
from qkv.engine.sdpa import scaled_dot_product_attention as _np_sdpa
from qkv.integrations.hf._mask import Mask
from qkv.integrations.hf._state import active as _recording
from qkv.integrations.hf._state import numpy as _numpy


class Spec:
    """One call's attention, in qkv's terms: the mask, the score mod, the sinks, the scale, the head grouping.

    Attributes:
        mask: a :class:`~qkv.hf._mask.Mask` or None (every key visible).
        dense: a 4-D mask a caller passed as a tensor (NumPy: bool True = may attend, or float added), or None.
        score_mod: :func:`qkv.mods.softcap` when the model soft-caps, else None.
        sinks: the learned sink logits (Hq,) as a tensor, or None.
        scale: the scores' multiplier.
        enable_gqa: Hk < Hq (grouped-query heads).
    """

    __slots__ = ("mask", "dense", "score_mod", "sinks", "scale", "enable_gqa")

    def weights(self, q: np.ndarray, k: np.ndarray, heads=None, rows=None) -> np.ndarray:
        """The attention weights of ``heads`` × ``rows`` (default all): (B, h, R, S) float, computed by qkv's
        stages from q (B, Hq, L, E) and k (B, Hk, S, E) — R × S per head, never L × S when rows are chosen."""
        B, Hq, L, _ = q.shape
        S = k.shape[-2]
        heads = np.arange(Hq) if heads is None else np.asarray(heads, dtype=np.int64)
        rows = np.arange(L) if rows is None else np.asarray(rows, dtype=np.int64)
        group = Hq // k.shape[1]
        qs = q[:, heads][:, :, rows]                                         # (B, h, R, E)
        ks = k[:, heads // group]                                            # (B, h, S, E)
        s = stages.scale(stages.score(qs, ks), self.scale)                   # (B, h, R, E) x (B, h, E, S) -> (B, h, R, S)
        if self.score_mod is not None:
            s = mods.call_score_mod(self.score_mod, s, np.arange(B).reshape(B, 1, 1, 1), heads.reshape(-1, 1, 1),
                                    rows[:, None], np.arange(S)[None, :])
        s = stages.apply_mask(s, self.mask_rows(rows, heads))
        sinks = None if self.sinks is None else _numpy(self.sinks)[heads].reshape(-1, 1, 1).astype(s.dtype)
        return stages.softmax(s, sinks=sinks)

    def mask_rows(self, rows: np.ndarray, heads: np.ndarray):
        """The mask of query rows ``rows`` and heads ``heads``: bool or float (B or 1, 1 or h, R, S), or None."""
        if self.dense is not None:
            d = self.dense if self.dense.shape[-2] == 1 else self.dense[..., rows, :]     # (B or 1, 1 or H, R, S)
            return d if d.shape[1] == 1 else d[:, heads]
        return None if self.mask is None else self.mask.dense(rows)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as ``"qkv"`` in ``transformers.AttentionInterface`` (see the module).

    Args:
        module: the attention layer (its ``layer_idx``, ``is_causal``, ``training`` are read).
        query: (B, Hq, L, E); key: (B, Hk, S, E); value: (B, Hk, S, Ev), torch tensors.
        attention_mask: a :class:`~qkv.hf._mask.Mask`, None, or a 4-D tensor (bool True = may attend, or float
            added to the scores).
        scaling: the scores' multiplier (None: 1/√E).
        dropout: the weights' dropout probability (transformers passes 0 outside training).
        kwargs: ``softcap``, ``s_aux`` (sinks), ``output_attentions``, ``is_causal``; others are ignored.

    Returns:
        ``(attn_output (B, L, Hq, Ev), attn_weights (B, Hq, L, S) or None)``, attn_weights with
        ``output_attentions=True``: computed by qkv's stages without gradient (a loss on them does not reach the
        layer's parameters) and before dropout.
    """
    import torch

    spec = _spec(module, query, key, attention_mask, scaling, kwargs)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (query, key, value, spec.sinks))
    if dropout and dropout > 0 and getattr(module, "training", True):
        out = _dropout_path(spec, query, key, value, float(dropout))
    elif grads:
        out = _torch_path(spec, query, key, value)
    else:
        out = _numpy_path(spec, query, key, value)
    weights = None
    if kwargs.get("output_attentions"):
        w = spec.weights(_numpy(query), _numpy(key))
        weights = torch.from_numpy(np.ascontiguousarray(w)).to(query.dtype)
    recorder = _recording()
    if recorder is not None:
        recorder.observe(module, spec, query, key, value)
    return out.transpose(1, 2).contiguous(), weights                          # (B, Hq, L, Ev) -> (B, L, Hq, Ev)


def _spec(module, query, key, attention_mask, scaling, kwargs) -> Spec:
    """The call's :class:`Spec`; ValueError / TypeError naming what does not fit."""
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(f"query, key: expected (B, H, L, E) and (B, Hk, S, E), got {tuple(query.shape)} and "
                         f"{tuple(key.shape)}")
    B, Hq, L, E = query.shape
    Hk, S = key.shape[1], key.shape[2]
    if Hq % Hk:
        raise ValueError(f"key: {Hk} key/value heads do not divide the query's {Hq} heads")
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias: a learned relative position bias (T5-style) is not supported on qkv; use "
                         "attn_implementation='eager' or 'sdpa' for this model")
    spec = Spec()
    spec.scale = float(scaling) if scaling is not None else E ** -0.5
    spec.enable_gqa = Hk != Hq
    softcap = kwargs.get("softcap")
    spec.score_mod = None if softcap is None else mods.softcap(float(softcap))
    spec.sinks = kwargs.get("s_aux")
    spec.mask, spec.dense = None, None
    if isinstance(attention_mask, Mask):
        if (attention_mask.q_length, attention_mask.kv_length) != (L, S):
            raise ValueError(f"attention_mask: built for L={attention_mask.q_length}, S={attention_mask.kv_length}, "
                             f"but the layer has L={L}, S={S}")
        spec.mask = attention_mask if attention_mask.mask_mod is not None else None
    elif attention_mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", False) if causal is None else causal
        if causal and L > 1:                                                 # sdpa's is_causal: top-left
            spec.mask = Mask(mods.causal(), B, L, S, per_batch=False, is_causal=True)
    elif hasattr(attention_mask, "ndim") and attention_mask.ndim == 4:
        spec.dense = _numpy(attention_mask) if attention_mask.dtype.is_floating_point else \
            attention_mask.detach().cpu().numpy().astype(bool)
    else:
        raise TypeError(f"attention_mask: expected a qkv.hf mask (attn_implementation='qkv' builds it), None or a "
                        f"4-D tensor, got {type(attention_mask).__name__} {getattr(attention_mask, 'shape', '')}")
    if spec.dense is not None and (spec.score_mod is not None or spec.sinks is not None):
        raise ValueError("attention_mask: a 4-D tensor mask together with softcap or sinks is not supported on qkv; "
                         "let transformers build the mask (pass the 2-D padding mask)")
    return spec


def _numpy_path(spec: Spec, query, key, value):
    """Forward without autograd: qkv's NumPy functions; (B, Hq, L, Ev) as a tensor of the query's dtype."""
    import torch

    q, k, v = _numpy(query), _numpy(key), _numpy(value)
    plain = spec.score_mod is None and spec.sinks is None
    if spec.dense is not None:
        out = _np_sdpa(q, k, v, attn_mask=spec.dense, scale=spec.scale, enable_gqa=spec.enable_gqa)
    elif plain and spec.mask is not None and spec.mask.is_causal:                # SDPA's causal path (~7 % faster)
        out = _np_sdpa(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=spec.enable_gqa)
    else:
        sinks = None if spec.sinks is None else _numpy(spec.sinks).astype(q.dtype)
        out = _np_flex(q, k, v, spec.score_mod, None if spec.mask is None else spec.mask.block_mask,
                       scale=spec.scale, enable_gqa=spec.enable_gqa, sink_logits=sinks)
    return torch.from_numpy(np.ascontiguousarray(out)).to(query.dtype)


def _qkv_torch():
    try:
        from qkv.integrations import torch as qkv_torch
    except ImportError as exc:                                   # qkv.torch not there (yet)
        raise ImportError(f"training a transformers model on qkv needs qkv.torch (the differentiable functions): "
                          f"{exc}") from None
    return qkv_torch


def _torch_path(spec: Spec, query, key, value):
    """Forward with autograd: ``qkv.torch`` (qkv's own backward)."""
    qt = _qkv_torch()
    if spec.dense is not None:
        import torch
        return qt.scaled_dot_product_attention(query, key, value, attn_mask=torch.from_numpy(spec.dense),
                                               scale=spec.scale, enable_gqa=spec.enable_gqa)
    return qt.flex_attention(query, key, value, score_mod=spec.score_mod,
                             block_mask=None if spec.mask is None else spec.mask.block_mask, scale=spec.scale,
                             enable_gqa=spec.enable_gqa, sink_logits=spec.sinks)


def _dropout_path(spec: Spec, query, key, value, p: float):
    """Training with attention dropout: ``qkv.torch.scaled_dot_product_attention`` on the mask's booleans."""
    import torch

    if spec.score_mod is not None or spec.sinks is not None:
        raise ValueError(f"dropout: attention dropout ({p}) with softcap or sinks is not supported on qkv; set the "
                         "config's attention_dropout to 0")
    mask = spec.dense if spec.dense is not None else (None if spec.mask is None else spec.mask.dense())
    attn_mask = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))
    return _qkv_torch().scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=p,
                                                     scale=spec.scale, enable_gqa=spec.enable_gqa)
