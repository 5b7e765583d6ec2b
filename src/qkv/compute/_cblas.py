"""CBLAS's enums, as :mod:`qkv.gemm` passes them to ``cblas_sgemm`` and the compiled kernels (:mod:`qkv.compute._jit`)
call it: a leaf, so neither imports the other."""
from __future__ import annotations

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112

__all__ = ["NO_TRANS", "ROW_MAJOR", "TRANS"]
