"""The compiled decoding step's glue (:mod:`qkv.models._decode_jit`): when it applies, and its arguments.

:meth:`qkv.models.llama.LlamaModel.step` asks :func:`compiled_step` for one new token of one sequence. It
applies when numba's kernels are in use, every projection of every layer and the LM head are kept as the file
stores them (:class:`~qkv.models._quant.QuantMatrix`, one type per kind of matrix across the layers) and the
caches hold one sequence of float32 rows, all stored alike: float32, float16 or int8 (or empty). Otherwise the
row-wise path runs (the same arithmetic, step by step).
"""
from __future__ import annotations

import math

import numpy as np

from qkv.compute import kv_decode
from qkv.core.kv_quant import BLOCK
from qkv.models import _quant
from qkv.models._quant import QuantMatrix

_KINDS = ("w_qkv", "w_o", "w_gate_up", "w_down")


class CompiledStep:
    """A model's weights laid out once for :func:`qkv.models._decode_jit.build`'s step (no copy of the
    quantized bytes: tuples of each layer's array)."""

    def __init__(self, model, step):
        c = model.config
        layers = model._layers
        self.model, self.step = model, step
        self.weights = tuple(tuple(getattr(layer, kind).data for layer in layers) for kind in _KINDS)
        self.kinds = tuple(tuple(int(v) for v in getattr(layers[0], kind)._layout[::-1]) for kind in _KINDS)
        self.kinds += (tuple(int(v) for v in model._lm_head_t._layout[::-1]),)
        self.attn_norm = np.stack([layer.attn_norm for layer in layers]).astype(np.float32)
        self.ffn_norm = np.stack([layer.ffn_norm for layer in layers]).astype(np.float32)
        self.norm = np.ascontiguousarray(model._norm, np.float32)
        self.dims = (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)
        self.scale = np.float32(1.0 / math.sqrt(c.head_dim))

    def __call__(self, ids: np.ndarray, caches) -> np.ndarray:
        """The logits (1, V) of token ids (1, 1) after the cached tokens; the caches extended by it."""
        model, c = self.model, self.model.config
        H, Hk, E, _ = self.dims
        pos = caches[0].offset
        if pos + 1 > c.context_length:
            raise ValueError(f"ids: position {pos}, beyond the model's context of {c.context_length} tokens")
        x = np.ascontiguousarray(model.embed(ids)[0], np.float32)          # (1, D)
        stored = [kv_decode.kernel_args(*cache.reserve_stored((1, Hk, 1, E), (1, Hk, 1, E), np.float32))[1:]
                  for cache in caches]
        logits = np.empty((1, c.vocab_size), np.float32)
        with _quant._PARALLEL:                                            # numba's workqueue: one at a time
            status = self.step(x, pos, model._cos[pos:pos + 1], model._sin[pos:pos + 1], self.dims, self.kinds,
                               np.float32(c.rms_norm_eps), self.scale, _quant._threads(), kv_decode.parts(pos + 1),
                               self.attn_norm, self.ffn_norm, *self.weights,
                               *(tuple(s[i] for s in stored) for i in range(4)), BLOCK, self.norm,
                               model._lm_head_t.data, logits)
        if status:
            for cache in caches:
                cache.truncate(pos)
            name, layer = ("key", "value")[(status - 1) % 2], (status - 1) // 2
            fits = ("within float16's range (|x| ≤ 65504) for a float16 cache" if caches[0].dtype == np.float16
                    else f"with max |x| ≤ {127 * 65504} per block of {BLOCK} for an int8 cache")
            raise ValueError(f"{name}: expected finite values {fits}, got others in layer {layer}'s new row")
        return logits


def compiled_step(model, ids: np.ndarray, caches) -> CompiledStep | None:
    """The model's compiled step if it applies to ``ids`` (B, L) and ``caches``, else None."""
    from qkv.compute.kernels import KERNELS

    storage = None if ids.shape != (1, 1) or KERNELS.get() != "numba" else _storage(caches, model.config)
    if storage is None:
        return None
    steps = model.__dict__.setdefault("_compiled", {})
    if storage not in steps:                                              # decided once per model and format
        steps[storage] = _build(model, storage)
    return steps[storage]


def _storage(caches, c) -> str | None:
    """``"f32"``, ``"f16"`` or ``"int8"`` where every cache holds float32 rows of one sequence (or nothing yet)
    stored that way, at one offset; else None."""
    if len({cache.offset for cache in caches}) != 1 or len({cache.dtype for cache in caches}) != 1:
        return None
    cache = caches[0]
    if cache.offset:
        keys = cache.storage()[0]
        if cache.row_dtype != np.float32 or keys.shape[:2] != (1, c.num_kv_heads) or keys.shape[3] != c.head_dim:
            return None
    return kv_decode.STORAGES[np.dtype(np.float32) if cache.dtype is None else cache.dtype]


def _build(model, storage: str) -> CompiledStep | None:
    from qkv.compute.kernels import KERNELS

    if _quant._kernels() is None or not isinstance(model._lm_head_t, QuantMatrix):
        return None
    layers = model._layers
    for kind in _KINDS:
        parts = [getattr(layer, kind) for layer in layers]
        if not all(isinstance(p, QuantMatrix) and p.qtype == parts[0].qtype for p in parts):
            return None
    from qkv.models import _decode_jit
    jit = KERNELS.jit()
    q8 = getattr(model, "activations", "float32") == "int8"
    return None if jit is None else CompiledStep(model, _decode_jit.build(jit, q8, storage))
