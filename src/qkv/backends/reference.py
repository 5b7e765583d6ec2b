"""The reference backend: the stages of :mod:`qkv.stages`, applied to whole arrays.

Plain and observable: every stage records into an active trace. It materializes the ``(…, L, S)`` score
matrix, so it is for small and medium sizes, for explanation, and as the yardstick of the tiled backend.
"""
from __future__ import annotations

import numpy as np

from .. import masks, stages
from . import register


@register("reference")
def reference_attention(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng,
                        return_weights, return_lse=False, threads=None):  # threads: unused, no workers here
    out_dtype = query.dtype
    if out_dtype == np.float16:                      # float16 computes in float32, returns float16
        query, key, value = (a.astype(np.float32) for a in (query, key, value))
    if enable_gqa:
        n_rep = query.shape[-3] // key.shape[-3]
        key = stages.repeat_kv(key, n_rep, name="K")              # (..., Hk, S, E) -> (..., Hq, S, E)
        value = stages.repeat_kv(value, n_rep, name="V")          # (..., Hk, S, Ev) -> (..., Hq, S, Ev)
    L, S = query.shape[-2], key.shape[-2]
    s = stages.score(query, key)                                  # (..., Hq, L, S)
    s = stages.scale(s, scale, d_k=query.shape[-1])
    if is_causal:
        attn_mask = masks.causal(L, S)                            # (L, S), top-left as in torch
    s = stages.apply_mask(s, attn_mask)
    if return_lse:
        w, lse = stages.softmax(s, return_lse=True)               # (..., Hq, L, S), (..., Hq, L)
    else:
        w, lse = stages.softmax(s), None                          # (..., Hq, L, S)
    if dropout_p > 0:
        w = stages.dropout(w, dropout_p, rng)
    out = stages.weighted_sum(w, value)                           # (..., Hq, L, Ev)
    out = out.astype(out_dtype, copy=False)
    w = w.astype(out_dtype, copy=False) if return_weights else None
    return (out, w, lse) if return_lse else (out, w)

