"""qkv — the attention system built on Q, K and V, exact and observable, in NumPy.

Mask convention everywhere: a boolean mask is **True where attention is allowed**.
"""
from qkv import _public

_public.install()  # qkv.masks, qkv.hf, qkv.backends, …: the public names of the modules in the layer folders

from qkv import explain  # noqa: E402  (qkv.explain: render, explain_query, check, examples)
from qkv.core import masks, mods, positions, stages  # noqa: E402  (qkv.mods: mask mods, score mods; qkv.positions)
from qkv.core.positions import RoPE, TokenEmbedding, sinusoidal_positions  # noqa: E402
from qkv.core.tracing import Step, Trace, trace  # noqa: E402
from qkv.compute.gemm import get_gemm, set_gemm  # noqa: E402  (the matrix multiply: "auto", "numpy", "mkl")
from qkv.compute.kernels import get_kernels, set_kernels  # noqa: E402  (block kernels: "auto", "numpy", "numba")
from qkv.engine import backends  # noqa: E402
from qkv.engine.api import (KVCache, attention_weights, get_num_threads,  # noqa: E402
                            scaled_dot_product_attention_backward, set_num_threads)
from qkv.engine.backends.configuration import config  # noqa: E402  (GEMM, kernels, threads, limits: one context)
from qkv.engine.flex import BlockMask, create_block_mask, flex_attention, flex_attention_backward  # noqa: E402
from qkv.engine.plans import check_plan, plan  # noqa: E402  (what a call would do; proven against the mask)
from qkv.engine.sdpa import attention, scaled_dot_product_attention  # noqa: E402
from qkv.nn.mha import MultiHeadAttention  # noqa: E402

__version__ = "0.1.0"


#: Subpackages imported on first attribute access (``qkv.models.load_bert``), so that ``import qkv`` stays light:
#: pictures and the page, the pretrained models (their optional dependencies are imported only when used, each
#: missing one an ImportError naming its extra). Every public module name of the layer folders (``qkv.lab``,
#: ``qkv.hf``, ``qkv.torch``, ``qkv.distributed``, ``qkv.kernels``, … :data:`qkv._public.PUBLIC`) is an attribute
#: the same way.
LAZY = ("viz", "models")


def __getattr__(name):
    if name in LAZY or f"qkv.{name}" in _public.PUBLIC:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(LAZY) | {name.removeprefix("qkv.") for name in _public.PUBLIC})

__all__ = [
    "BlockMask",
    "create_block_mask",
    "flex_attention",
    "flex_attention_backward",
    "plan",
    "check_plan",
    "config",
    "get_kernels",
    "set_kernels",
    "mods",
    "KVCache",
    "attention_weights",
    "get_gemm",
    "get_num_threads",
    "scaled_dot_product_attention_backward",
    "set_gemm",
    "set_num_threads",
    "MultiHeadAttention",
    "RoPE",
    "Step",
    "TokenEmbedding",
    "Trace",
    "attention",
    "backends",
    "explain",
    "masks",
    "positions",
    "scaled_dot_product_attention",
    "sinusoidal_positions",
    "stages",
    "trace",
]
