"""Compute providers, below the core: the GEMM provider (MKL through ctypes, or NumPy), the block kernels
(NumPy, or compiled with numba: ``_jit``, ``_jit_mods``) and the counter of the engine's paths.

They sit below :mod:`qkv.core` because the core's stages multiply and normalise with them: the one computation
path uses the same matmul and softmax as the tiled engine. They import nothing of qkv above the leaves.
"""
