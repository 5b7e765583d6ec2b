"""The reference backend: :func:`qkv.pipeline.attend` — the stages of :mod:`qkv.stages` on whole arrays.

Plain and observable: every stage records into an active trace. It materializes the ``(…, L, S)`` score
matrix, so it is for small and medium sizes, for explanation, and as the yardstick of the tiled backend.
Its backward is the textbook formula on whole arrays (``dS = P ∘ (dP − D)``) on the forward's own
probabilities (it runs :func:`qkv.pipeline.attend` and reads the scaled scores from its trace), the yardstick
of the tiled backward.
"""
from __future__ import annotations

import numpy as np

from qkv import _checks
from qkv.core import masks, pipeline, shapes, stages
from qkv.core.tracing import Trace, trace as tracing
from qkv.engine.backends.base import Backend


def _fits_dense(lead: tuple, L: int, S: int, dtype, copies: int, weights: bool) -> None:
    """Before the reference path materializes ``copies`` arrays of the (…, L, S) scores: a ValueError saying how
    much they need and what to ask for instead, where this process cannot have it (:func:`qkv._checks.fits`)."""
    instead = (_checks.FEWER_WEIGHTS if weights
               else "backend='tiled' (or None) computes it in blocks, in memory linear in L and S")
    _checks.fits_scores(lead + (L, S), _checks.compute_dtype(dtype).itemsize, copies, "the dense scores", instead)


class ReferenceBackend(Backend):
    name = "reference"
    features = frozenset({"mask", "causal", "dropout", "weights", "lse", "score_mod", "block_mask", "sinks",
                          "backward"})

    def prefers(self, query, key, value, *, enable_gqa=False) -> bool:
        return True                                  # the fallback for everything the others do not take

    @staticmethod
    def _dense_mask(attn_mask, is_causal, block_mask, lead, L, S):
        """One mask for the whole scores: attn_mask, the causal triangle, and a block mask's mask_mod."""
        mask = masks.causal(L, S) if is_causal else attn_mask                 # (L, S) top-left, as torch
        if block_mask is not None:
            dense = block_mask.dense(lead, L, S)                              # bool, broadcastable
            mask = dense if mask is None else (masks.combine(mask, dense) if mask.dtype == np.bool_
                                               else mask + masks.to_additive(dense, mask.dtype))
        return mask

    def forward(self, query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale,
                enable_gqa=False, rng=None, return_weights=False, return_lse=False, threads=None,
                score_mod=None, block_mask=None, sink_logits=None):
        out_dtype = query.dtype
        if out_dtype == np.float16:                      # float16 computes in float32, returns float16
            query, key, value = (a.astype(np.float32) for a in (query, key, value))
        rep = shapes.n_rep(query.shape, key.shape, enable_gqa)
        if rep > 1:
            key = stages.repeat_kv(key, rep, name="K")                # (..., Hk, S, E) -> (..., Hq, S, E)
            value = stages.repeat_kv(value, rep, name="V")            # (..., Hk, S, Ev) -> (..., Hq, S, Ev)
        L, S = query.shape[-2], key.shape[-2]
        lead = shapes.lead(query.shape, key.shape, False)
        _fits_dense(lead, L, S, query.dtype, 3, return_weights)   # scores, their masked copy and the weights
        mask = self._dense_mask(attn_mask, is_causal, block_mask, lead, L, S)
        source = (block_mask.mask_mod if block_mask is not None else "causal" if is_causal
                  else None if attn_mask is None else "attn_mask")
        out, w, lse = pipeline.attend(query, key, value, scale=scale, mask=mask, mask_source=source,
                                      score_mod=score_mod, sink_logits=sink_logits, dropout_p=dropout_p, rng=rng)
        if out.ndim > len(lead) + 2:                     # sinks (H, 1, 1) broadcast a head axis onto (L, S) scores
            out, w, lse = out.reshape(lead + out.shape[-2:]), w.reshape(lead + w.shape[-2:]), lse.reshape(lead + (L,))
        out = out.astype(out_dtype, copy=False)
        w = w.astype(out_dtype, copy=False) if return_weights else None
        return out, w, (lse if return_lse else None)

    def backward(self, grad_out, query, key, value, *, attn_mask=None, is_causal=False, scale,
                 enable_gqa=False, threads=None, score_mod=None, block_mask=None, sink_logits=None,
                 out=None, lse=None):
        """The gradients on whole arrays (float64 for float64 inputs, float32 otherwise)::

            s = Q·Kᵀ·scale → s' = score_mod(s) → mask → P = softmax(s' [, sinks]) → O = P·V
            dV = Pᵀ·dO,  dP = dO·Vᵀ,  D = rowsum(dO ∘ O),  dS' = P ∘ (dP − D),  dS = dS' · ∂s'/∂s (or the
            mod's vjp of dS'),
            dQ = dS·K·scale,  dK = dSᵀ·Q·scale,  d sink_h = −Σ_i P_sink,i · D_i
        """
        cdt = _checks.compute_dtype(query.dtype)
        q, k, v, do = (a.astype(cdt, copy=False) for a in (query, key, value, grad_out))
        rep = shapes.n_rep(query.shape, key.shape, enable_gqa)
        if rep > 1:
            k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)      # (..., Hq, S, ·)
        L, S = q.shape[-2], k.shape[-2]
        lead = shapes.lead(q.shape, k.shape, False)
        _fits_dense(lead, L, S, cdt, 5, False)                   # the forward's three, then dP and dS
        mask = self._dense_mask(attn_mask, is_causal, block_mask, lead, L, S)
        t = Trace()
        with tracing(t):                 # the forward's own path: P, O and lse, and its scaled scores from its trace
            o, p, lse = pipeline.attend(q, k, v, scale=scale, mask=mask, score_mod=score_mod, sink_logits=sink_logits)
        s = t[stages.Names.SCALED].array                                     # (..., H, L, S) before the mod
        if o.ndim > len(lead) + 2:                       # sinks (H, 1, 1) broadcast a head axis onto (L, S) scores
            o, p, lse = o.reshape(lead + o.shape[-2:]), p.reshape(lead + p.shape[-2:]), lse.reshape(lead + (L,))
        vjp, ds_mod_ds = False, None
        if score_mod is not None:
            from qkv.core import mods
            s = np.broadcast_to(s, lead + (L, S))
            b, h, q_idx, kv_idx = pipeline.indices(lead, L, S)
            vjp = isinstance(score_mod, mods.ScoreMod) and score_mod.has_vjp
            ds_mod_ds = None if vjp else mods.score_mod_grad(score_mod, s, b, h, q_idx, kv_idx)
        dv = np.swapaxes(p, -1, -2) @ do                                     # (..., H, S, Ev)
        dp = do @ np.swapaxes(v, -1, -2)                                     # (..., H, L, S)
        D = np.sum(do * o, axis=-1, keepdims=True)                           # (..., H, L, 1)
        ds = p * (dp - D)
        if vjp:                                                              # dS = dS'·∂s'/∂s by the mod
            ds = mods.score_mod_vjp(score_mod, s, b, h, q_idx, kv_idx, ds)
        elif ds_mod_ds is not None:
            ds = ds * ds_mod_ds
        dq = (ds @ k) * cdt.type(scale)                                      # (..., H, L, E)
        dk = (np.swapaxes(ds, -1, -2) @ q) * cdt.type(scale)                 # (..., H, S, E)
        if rep > 1:                                                          # a kv head sums its query heads
            dk = dk.reshape(dk.shape[:-3] + (dk.shape[-3] // rep, rep) + dk.shape[-2:]).sum(axis=-3)
            dv = dv.reshape(dv.shape[:-3] + (dv.shape[-3] // rep, rep) + dv.shape[-2:]).sum(axis=-3)
        dt = query.dtype
        grads = (shapes.sum_to_shape(dq, query.shape).astype(dt, copy=False),
                 shapes.sum_to_shape(dk, key.shape).astype(dt, copy=False),
                 shapes.sum_to_shape(dv, value.shape).astype(dt, copy=False))
        if sink_logits is None:
            return grads
        sinks = np.asarray(sink_logits, cdt).reshape(-1, 1, 1)
        with np.errstate(invalid="ignore"):
            p_sink = np.exp(sinks - lse[..., None])                          # (..., H, L, 1): the sink's weight
        d_sink = -(p_sink * D)[..., 0]                                       # (..., H, L)
        H = sinks.shape[0]                                                   # one logit per query head
        d_sink = np.broadcast_to(d_sink, d_sink.shape[:-2] + (H, L)).reshape(-1, H, L).sum(axis=(0, 2))
        return grads + (d_sink.astype(np.asarray(sink_logits).dtype, copy=False),)            # (H,)


REFERENCE = ReferenceBackend()
