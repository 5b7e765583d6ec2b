"""The engine: the public calls (``sdpa``: :func:`qkv.scaled_dot_product_attention`; ``flex``; ``api``: the
backward, chosen rows of the weights, threads; ``plans``: :func:`qkv.plan`) over the backends (reference,
torch, tiled), the one place a backend is chosen (``backends.select``) and the runtime that owns the pools and
caches. Public as ``qkv.sdpa``, ``qkv.flex``, ``qkv.plans``, ``qkv.backends`` (:mod:`qkv._public`); the
names below are those ``qkv.engine`` always exported.
"""
from qkv.engine.api import (BACKWARD_WHOLE_SCORES, KVCache, attention_weights, get_num_threads,
                            scaled_dot_product_attention_backward, set_num_threads)

__all__ = ["BACKWARD_WHOLE_SCORES", "KVCache", "attention_weights", "get_num_threads",
           "scaled_dot_product_attention_backward", "set_num_threads"]
