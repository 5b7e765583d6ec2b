"""qkv — the attention system built on Q, K and V, exact and observable, in NumPy.

Mask convention everywhere: a boolean mask is **True where attention is allowed**.
"""
from . import backends, masks, stages
from . import explain  # noqa: E402  (qkv.explain: render, explain_query, check, examples)
from .sdpa import attention, scaled_dot_product_attention
from .engine import KVCache, attention_weights, get_num_threads, scaled_dot_product_attention_backward, set_num_threads
from .mha import MultiHeadAttention
from . import mods  # noqa: E402  (qkv.mods: mask mods, score mods)
from .flex import BlockMask, create_block_mask, flex_attention, flex_attention_backward
from .plans import check_plan, plan  # what a call would do, made by the code it runs; proven against the mask
from . import positions  # qkv.positions: rope, cos_sin, RoPE, sinusoidal_positions
from .positions import RoPE, TokenEmbedding, sinusoidal_positions
from .tracing import Step, Trace, trace
from .gemm import get_gemm, set_gemm  # the engine's matrix multiply: "auto", "numpy" or "mkl" (qkv[mkl])
from .kernels import get_kernels, set_kernels  # the engine's block kernels: "auto", "numpy" or "numba" (qkv[jit])
from .backends.configuration import config  # GEMM, kernels, threads, limits for a with block (one context variable)

__version__ = "0.1.0"


#: Subpackages imported on first attribute access (``qkv.models.load_bert``), so that ``import qkv`` stays light:
#: pictures and the page, the pretrained models, the lab's experiments, ring attention (their optional
#: dependencies are imported only when used, each missing one an ImportError naming its extra).
LAZY = ("viz", "models", "lab", "distributed", "hf", "torch")


def __getattr__(name):
    if name in LAZY:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(LAZY))

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
