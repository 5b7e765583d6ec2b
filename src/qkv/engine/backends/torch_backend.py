"""The torch backend: ``torch.nn.functional.scaled_dot_product_attention`` with qkv's semantics.

Torch tensors given to :func:`qkv.scaled_dot_product_attention` run here on their own device (CPU, CUDA, …)
and come back as torch tensors; ``backend="torch"`` sends NumPy arrays here too (they come back as NumPy).
Importing this module does not import torch; calling the backend does.

What qkv adds to torch's SDPA: a query row that may attend to nothing returns zeros (torch may give NaN);
float16 NumPy inputs compute in float32, like the other backends. With ``return_weights`` or ``return_lse``
the plain formula runs (``softmax(Q·Kᵀ·scale + mask)``, materializing (…, L, S)), so that the weights, the
dropout and the output agree. Dropout uses torch's random generator (seed it with ``torch.manual_seed``);
a NumPy ``rng`` is rejected rather than silently ignored.
"""
from __future__ import annotations

import numpy as np

from qkv.engine.backends.base import Backend


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("the torch backend needs torch: pip install 'qkv[torch]'") from None
    return torch


def is_torch_tensor(x) -> bool:
    """True for a torch tensor, without importing torch."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def torch_attention(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng,
                    return_weights, return_lse=False, threads=None):   # threads: unused, torch's own setting
    torch = _torch()
    numpy_in = isinstance(query, np.ndarray)
    if rng is not None and dropout_p > 0:
        raise ValueError("rng: torch computes dropout with its own generator (seed it with torch.manual_seed); "
                         "expected rng=None with torch tensors or backend='torch'")
    if numpy_in:
        out_dtype = query.dtype
        cdt = np.float32 if query.dtype == np.float16 else query.dtype
        q, k, v = (torch.from_numpy(np.ascontiguousarray(a, dtype=cdt)) for a in (query, key, value))
        mask = None if attn_mask is None else torch.from_numpy(np.ascontiguousarray(attn_mask))
    else:
        q, k, v = query, key, value
        mask = attn_mask
        if mask is not None and not is_torch_tensor(mask):
            mask = torch.as_tensor(np.asarray(mask), device=q.device)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if mask is not None:
        mask = mask.to(q.device)
    weights = lse = None
    if return_weights or return_lse:
        out, weights, lse = _math(torch, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    else:
        kw = {"enable_gqa": True} if enable_gqa else {}
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                               is_causal=is_causal, scale=scale, **kw)
        if mask is not None:                                    # rows with nothing to attend to → 0
            dead = ~(mask if mask.dtype == torch.bool else mask > float("-inf")).any(dim=-1)  # (..., L)
            out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    if numpy_in:
        out = out.numpy().astype(out_dtype, copy=False)
        weights = None if weights is None else weights.numpy().astype(out_dtype, copy=False)
        lse = None if lse is None else lse.numpy()
    weights = weights if return_weights else None
    return (out, weights, lse) if return_lse else (out, weights)


def _math(torch, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    """The plain formula in torch: (output, weights after dropout, lse)."""
    if enable_gqa:
        n_rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(n_rep, dim=-3)                  # (..., Hk, S, E) -> (..., Hq, S, E)
        v = v.repeat_interleave(n_rep, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale                       # (..., L, E) x (..., E, S) -> (..., L, S)
    if is_causal:
        L, S = s.shape[-2:]
        mask = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    m = s.amax(dim=-1, keepdim=True)                            # (..., L, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    w = e / torch.where(total == 0, torch.ones_like(total), total)
    lse = (m + torch.log(total)).squeeze(-1)                    # log 0 = −inf on fully masked rows
    if dropout_p > 0:
        w = torch.nn.functional.dropout(w, p=dropout_p)
    return w @ v, w, lse


class TorchBackend(Backend):
    """torch's SDPA (forward only; torch tensors on any device, or NumPy arrays)."""

    name = "torch"
    features = frozenset({"mask", "causal", "dropout", "weights", "lse"})

    def forward(self, query, key, value, *, return_lse=False, score_mod=None, block_mask=None,
                sink_logits=None, **kw):
        if score_mod is not None or block_mask is not None or sink_logits is not None:
            raise ValueError("backend: 'torch' computes plain SDPA; score_mod, block_mask and sink_logits "
                             "run on the 'reference' or 'tiled' backend")
        res = torch_attention(query, key, value, return_lse=return_lse, **kw)
        return res[0], res[1], (res[2] if return_lse else None)


TORCH = TorchBackend()
