"""Multi-head attention: project → split heads → attention per head → concat → W_O.

Seed 000's shapes, for embed_dim D = 512 and 8 heads (d_k = E = 64)::

    X (B, T, D) · W_Q (D, H·E) → Q (B, T, H·E) → view/transpose → Q_heads (B, H, T, E)
    per head: softmax(Q_h · K_hᵀ / √E) · V_h → (B, H, L, E) → concat (B, L, H·E) → · W_O (D, D) → (B, L, D)

With ``rope=qkv.RoPE(...)`` each head's Q (B, H, L, E) and K (B, Hk, L, E) are rotated after the split
(recorded as ``Q_rot``, ``K_rot``), before the keys go into a :class:`qkv.KVCache`.
Shape legend: B batch, H query heads, Hk key/value heads, L query length, S key length, E head width.
"""
from __future__ import annotations

import numpy as np

from qkv import _checks
from qkv.core import masks, pipeline
from qkv.core.positions import RoPE
from qkv.engine.sdpa import scaled_dot_product_attention
from qkv.core.tracing import Trace, maybe


class MultiHeadAttention:
    """Multi-head attention with the seeds' weight layout (``Q = X @ W_Q``).

    Args:
        embed_dim: D, the width of the query input and of the output.
        num_heads: H, query heads; ``embed_dim`` must be a multiple of it (head width E = D / H).
        bias: learn biases b_Q, b_K, b_V, b_O.
        kdim, vdim: widths of the key and value inputs for cross-attention (default D).
        num_kv_heads: Hk key/value heads (default H); Hk < H is grouped-query attention, 1 multi-query.
        batch_first: inputs are (B, T, D) when True, (T, B, D) when False; (T, D) is always unbatched.
        dtype: float16, float32 or float64 parameters and computation.
        seed: seed of the initialization (Xavier-uniform projections, zero biases, as torch).
        rope: a :class:`qkv.RoPE` rotating each head's Q and K by its token's position (self-attention only;
            the head width E must be even), or None (no positions inside attention).

    Attributes (NumPy arrays): ``W_Q`` (D, H·E), ``W_K`` (kdim, Hk·E), ``W_V`` (vdim, Hk·E), ``W_O`` (D, D),
    ``b_Q`` (H·E,), ``b_K``/``b_V`` (Hk·E,), ``b_O`` (D,) — biases are None when ``bias=False``.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, bias: bool = True, kdim: int | None = None,
                 vdim: int | None = None, num_kv_heads: int | None = None, batch_first: bool = True,
                 dtype=np.float32, seed=None, rope: RoPE | None = None):
        self.embed_dim = _checks.positive_int(embed_dim, "embed_dim")
        self.num_heads = _checks.positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) is not a multiple of num_heads ({num_heads})")
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else _checks.positive_int(kdim, "kdim")
        self.vdim = embed_dim if vdim is None else _checks.positive_int(vdim, "vdim")
        self.num_kv_heads = num_heads if num_kv_heads is None else _checks.positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        self.bias = _checks.boolean(bias, "bias")
        self.batch_first = _checks.boolean(batch_first, "batch_first")
        self.dtype = dt = _checks.float_dtype(dtype, "dtype")
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope: expected a qkv.RoPE or None, got {type(rope).__name__} {rope!r}")
        if rope is not None and self.head_dim % 2:
            raise ValueError(f"rope: RoPE rotates pairs of coordinates, expected an even head width, got "
                             f"head_dim = embed_dim / num_heads = {self.head_dim}")
        self.rope = rope
        rng = np.random.default_rng(_checks.seed(seed))
        D, E, Hk = self.embed_dim, self.head_dim, self.num_kv_heads

        def xavier(fan_in, fan_out):
            bound = np.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-bound, bound, (fan_in, fan_out)).astype(dt)

        self.W_Q = xavier(D, D)                                        # (D, H·E)
        self.W_K = xavier(self.kdim, Hk * E)                           # (kdim, Hk·E)
        self.W_V = xavier(self.vdim, Hk * E)                           # (vdim, Hk·E)
        self.W_O = rng.uniform(-1 / np.sqrt(D), 1 / np.sqrt(D), (D, D)).astype(dt)   # (H·E, D)
        self.b_Q = np.zeros(D, dt) if bias else None
        self.b_K = np.zeros(Hk * E, dt) if bias else None
        self.b_V = np.zeros(Hk * E, dt) if bias else None
        self.b_O = np.zeros(D, dt) if bias else None

    # ------------------------------------------------------------------ weights
    _SHAPES = {"W_Q": lambda m: (m.embed_dim, m.embed_dim),
               "W_K": lambda m: (m.kdim, m.num_kv_heads * m.head_dim),
               "W_V": lambda m: (m.vdim, m.num_kv_heads * m.head_dim),
               "W_O": lambda m: (m.embed_dim, m.embed_dim),
               "b_Q": lambda m: (m.embed_dim,),
               "b_K": lambda m: (m.num_kv_heads * m.head_dim,),
               "b_V": lambda m: (m.num_kv_heads * m.head_dim,),
               "b_O": lambda m: (m.embed_dim,)}

    def parameters(self) -> dict[str, np.ndarray | None]:
        """The weights by name: W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O."""
        return {name: getattr(self, name) for name in self._SHAPES}

    def load(self, **weights) -> "MultiHeadAttention":
        """Set weights by name (e.g. ``load(W_Q=..., b_Q=...)``), checking shapes; returns self."""
        for name, value in weights.items():
            if name not in self._SHAPES:
                raise ValueError(f"{name}: not a weight; expected one of {list(self._SHAPES)}")
            if value is None:
                if name.startswith("b_") and not self.bias:
                    continue
                raise ValueError(f"{name}: expected an array, got None (only biases of a bias=False module "
                                 "may be None)")
            if name.startswith("b_") and not self.bias:
                raise ValueError(f"{name}: this module was built with bias=False")
            arr = _checks.float_array(value, name)
            expected = self._SHAPES[name](self)
            if arr.shape != expected:
                raise ValueError(f"{name}: expected shape {expected}, got {arr.shape}")
            with np.errstate(over="ignore"):
                cast = arr.astype(self.dtype)
            if not np.all(np.isfinite(cast)):                             # finite float64 beyond float32/16
                raise ValueError(f"{name}: expected values within {self.dtype}'s range (±{np.finfo(self.dtype).max:.4g}),"
                                 f" got {float(np.max(np.abs(arr))):.6g}")
            setattr(self, name, cast)
        return self

    @classmethod
    def from_torch(cls, module) -> "MultiHeadAttention":
        """Build an instance with the weights of a ``torch.nn.MultiheadAttention``.

        Handles the packed ``in_proj_weight`` and the separate q/k/v projections (kdim/vdim ≠ embed_dim),
        with or without bias, batch_first either way. Torch's ``add_bias_kv`` and ``add_zero_attn`` are not
        supported (ValueError). Remember torch's masks mean True = *blocked*: pass ``~mask`` to qkv.
        """
        try:
            import torch
        except ImportError:  # pragma: no cover - exercised only without torch
            raise ImportError("MultiHeadAttention.from_torch needs torch: pip install 'qkv[torch]'") from None
        if not isinstance(module, torch.nn.MultiheadAttention):
            raise TypeError(f"module: expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("module: add_bias_kv and add_zero_attn are not supported by qkv")

        def np_(t):
            return None if t is None else t.detach().cpu().numpy().copy()

        D = module.embed_dim
        dtype = module.out_proj.weight.dtype
        np_dtype = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}.get(dtype)
        if np_dtype is None:
            raise TypeError(f"module: expected float16/32/64 weights, got {dtype}")
        has_bias = module.in_proj_bias is not None
        m = cls(D, module.num_heads, bias=has_bias, kdim=module.kdim, vdim=module.vdim,
                batch_first=bool(module.batch_first), dtype=np_dtype)
        if module._qkv_same_embed_dim:
            w = np_(module.in_proj_weight)                               # (3D, D), used as x @ w.T
            w_q, w_k, w_v = w[:D].T, w[D:2 * D].T, w[2 * D:].T
        else:
            w_q, w_k, w_v = (np_(module.q_proj_weight).T, np_(module.k_proj_weight).T, np_(module.v_proj_weight).T)
        weights = dict(W_Q=w_q, W_K=w_k, W_V=w_v, W_O=np_(module.out_proj.weight).T)
        if has_bias:
            b = np_(module.in_proj_bias)
            weights.update(b_Q=b[:D], b_K=b[D:2 * D], b_V=b[2 * D:], b_O=np_(module.out_proj.bias))
        return m.load(**weights)

    # ------------------------------------------------------------------ forward
    def _input(self, x, name: str, width: int) -> np.ndarray:
        x = _checks.float_array(x, name)
        if x.ndim not in (2, 3):
            raise ValueError(f"{name}: expected shape {'(B, T, ' if self.batch_first else '(T, B, '}{width}) or "
                             f"(T, {width}), got {x.shape}")
        if x.shape[-1] != width:
            raise ValueError(f"{name}: expected last dimension {width}, got {x.shape[-1]} (shape {x.shape})")
        if 0 in x.shape:
            raise ValueError(f"{name}: expected no empty dimension, got shape {x.shape}")
        if x.ndim == 3 and not self.batch_first:
            x = x.transpose(1, 0, 2)                                   # (T, B, D) -> (B, T, D)
        return x.astype(self.dtype, copy=False)

    def forward(self, query, key=None, value=None, *, key_mask=None, attn_mask=None, is_causal=False,
                need_weights=False, average_attn_weights=True, trace: Trace | None = None, cache=None,
                positions=None):
        """Attention of ``query`` over ``key``/``value`` (default: ``query`` — self-attention).

        Args:
            query: (B, L, D) (or (L, B, D) when not batch_first, or unbatched (L, D)).
            key: (B, S, kdim), default ``query``; value: (B, S, vdim), default ``key``.
            key_mask: bool (B, S), **True where the key is a real token** (padding is False).
            attn_mask: bool (True = may attend) or float (added to the scores), of shape (L, S), (B·H, L, S)
                or broadcastable to (B, H, L, S).
            is_causal: query i may attend to keys 0..i (top-left); combines with the masks above.
            need_weights: also return the attention weights.
            average_attn_weights: average the weights over heads, (B, L, S); else (B, H, L, S).
            trace: a :class:`qkv.Trace` to record every stage into.
            cache: a :class:`qkv.KVCache` for incremental decoding: the new tokens' keys and values are
                appended to it and the queries attend to all cached tokens (S = cached + new). Causal is then
                aligned bottom-right (the queries are the last positions); key_mask is (B, S) and attn_mask
                (L, S) over all S tokens.
            positions: only with ``rope``: integer positions ≥ 0 of the query tokens, (L,) or (B, L) in either
                layout (unbatched: (L,)); default 0 … L−1, or ``cache.offset`` + 0 … L−1 with a cache. The keys of
                these tokens get the same positions. RoPE is for self-attention: with a separate ``key`` input it raises ValueError
                (keys from another sequence have no positions in the queries' frame).

        Returns:
            ``(output, weights)``: output (B, L, D) in the input layout; weights as above or None.
            A query that may attend to no key gets a zero attention output (its output is then b_O).
        """
        _checks.boolean(need_weights, "need_weights")
        _checks.boolean(average_attn_weights, "average_attn_weights")
        _checks.boolean(is_causal, "is_causal")
        unbatched = getattr(query, "ndim", None) == 2
        q_in, k_in, v_in = self._inputs(query, key, value, unbatched)   # (B, L, D), (B, S, kdim), (B, S, vdim)
        B, L, _ = q_in.shape
        S = k_in.shape[1]
        H, Hk = self.num_heads, self.num_kv_heads
        offset = 0
        if cache is not None:
            from qkv.core.cache import KVCache
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache: expected a qkv.KVCache or None, got {type(cache).__name__}")
            offset = cache.offset
            S += offset                                                # the queries see every cached token
        positions = self._positions(positions, key, B, L, offset, unbatched)   # (L,) or (B, L) | None
        mask = self._mask(key_mask, attn_mask, is_causal, B, L, S, unbatched,
                          align="top-left" if cache is None else "bottom-right")

        def attend(q, k, v, rows):                                     # the dispatching SDPA, every backend
            res = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hk != H,
                                               return_weights=need_weights)
            return res if need_weights else (res, None)                # (B, H, L, E), (B, H, L, S) | None

        with maybe(trace):
            out, w = pipeline.layer(q_in, self.W_Q, self.W_K, self.W_V, self.W_O,
                                    x_kv=None if key is None else k_in,
                                    x_v=None if v_in is k_in else v_in, b_q=self.b_Q, b_k=self.b_K,
                                    b_v=self.b_V, b_o=self.b_O, heads=H, kv_heads=Hk, rope=self.rope,
                                    positions=positions, cache=cache, attend=attend)        # (B, L, D)
        if need_weights:
            w = w.mean(axis=1) if average_attn_weights else w          # (B, L, S) or (B, H, L, S)
        else:
            w = None
        if unbatched:
            out = out[0]
            w = None if w is None else w[0]
        elif not self.batch_first:
            out = out.transpose(1, 0, 2)                               # (B, L, D) -> (L, B, D)
        return out, w

    __call__ = forward

    def _inputs(self, query, key, value, unbatched: bool):
        """query, key, value as (B, T, width) arrays of the module's dtype (key defaults to query, value to
        key), checked against each other."""
        q_in = self._input(query, "query", self.embed_dim)
        k_in = q_in if key is None else self._input(key, "key", self.kdim)
        v_in = k_in if value is None else self._input(value, "value", self.vdim)
        if value is None and key is not None and self.vdim != self.kdim:
            raise ValueError(f"value: expected an input of width vdim={self.vdim} (key has kdim={self.kdim})")
        for name, x in (("key", k_in), ("value", v_in)):
            if x.ndim != q_in.ndim:
                raise ValueError(f"{name}: expected {'unbatched (S, width)' if unbatched else 'batched'} input "
                                 f"like query {q_in.shape}, got {x.shape}")
        if unbatched:
            q_in, k_in, v_in = q_in[None], k_in[None], v_in[None]      # (1, T, D)
        if k_in.shape[:2] != v_in.shape[:2]:
            raise ValueError(f"value: expected batch and length {k_in.shape[:2]} (as key), got {v_in.shape[:2]}")
        if k_in.shape[0] != q_in.shape[0]:
            raise ValueError(f"key: expected batch size {q_in.shape[0]} (as query), got {k_in.shape[0]}")
        return q_in, k_in, v_in

    def _positions(self, positions, key, B, L, offset, unbatched):
        """The query tokens' positions for RoPE: (L,) or (B, L) int64, or None without rope."""
        if self.rope is None:
            if positions is not None:
                raise ValueError("positions: only used with rope (MultiHeadAttention(..., rope=qkv.RoPE())), "
                                 "got positions for a module without rope")
            return None
        if key is not None:
            raise ValueError("key: rope applies to self-attention only (queries and keys at positions of one "
                             "sequence); got a separate key input — use a module without rope for cross-attention")
        if positions is None:
            return np.arange(offset, offset + L, dtype=np.int64)       # (L,)
        p = np.asarray(positions) if isinstance(positions, (list, tuple, range)) else positions
        if not isinstance(p, np.ndarray) or p.dtype == np.bool_ or not np.issubdtype(p.dtype, np.integer):
            raise TypeError(f"positions: expected an integer numpy array, got "
                            f"{getattr(p, 'dtype', type(p).__name__)}")
        allowed = [(L,)] if unbatched else [(L,), (B, L)]
        if p.shape not in allowed:
            raise ValueError(f"positions: expected shape {' or '.join(map(str, allowed))} (L = query length, "
                             f"B = batch), got {p.shape}")
        if p.size and p.min() < 0:
            raise ValueError(f"positions: expected non-negative integers, got {int(p.min())}")
        return p.astype(np.int64, copy=False)

    def _mask(self, key_mask, attn_mask, is_causal, B, L, S, unbatched, align="top-left"):
        """One mask for SDPA, broadcastable to (B, H, L, S), from the three ways of giving one."""
        parts = []
        if key_mask is not None:
            km = np.asarray(key_mask) if isinstance(key_mask, (list, tuple)) else key_mask
            if not isinstance(km, np.ndarray) or km.dtype != np.bool_:
                raise TypeError(f"key_mask: expected a bool array (True = real token), got "
                                f"{getattr(km, 'dtype', type(km).__name__)}")
            expected = (S,) if unbatched else (B, S)
            if km.shape != expected:
                raise ValueError(f"key_mask: expected shape {expected}, got {km.shape}")
            parts.append(km.reshape(B, 1, 1, S))                       # (B, 1, 1, S)
        if is_causal:
            parts.append(masks.causal(L, S, align=align))              # (L, S)
        bool_mask = masks.combine(*parts)
        if attn_mask is None:
            return bool_mask
        cdt = _checks.compute_dtype(self.dtype)
        am = _checks.mask_array(attn_mask, "attn_mask", cdt)
        if am.ndim == 3 and am.shape[0] == B * self.num_heads and am.shape[0] != 1:
            am = am.reshape(B, self.num_heads, L, S) if am.shape[1:] == (L, S) else am
        _checks.broadcastable(am.shape, (B, self.num_heads, L, S), "attn_mask", "(B, H, L, S) =")
        if am.dtype == np.bool_:
            return masks.combine(bool_mask, am)
        am = am.astype(cdt)
        return am if bool_mask is None else am + masks.to_additive(bool_mask, am.dtype)
