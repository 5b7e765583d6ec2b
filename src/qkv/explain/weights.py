"""A worked example's attention weights alone, at any size: what ``qkv heatmap`` draws.

:func:`qkv.explain.examples.run` keeps the whole trace — X, Q, K, V and five or six (L, S) steps in float64,
about 40 bytes a weight before anything is drawn. A large example (:func:`~qkv.explain.examples.is_large`)
instead runs through :func:`~qkv.explain.examples.run_rows` block by block of query rows, and only each
block's weights are kept, in float32: 4 bytes a weight.
"""
from __future__ import annotations

import numpy as np

from qkv.explain import examples


#: Weights a block of query rows holds (4 MB a step in float64): the blocks stay small beside the float32 result.
BLOCK_CELLS = 1 << 19


def attention_weights(worked) -> np.ndarray:
    """The weights (…, L, S) qkv computes for ``worked``: ``run(worked)["weights"]`` (float64) for an example
    that is not large; for a large one the same numbers block by block, kept in float32. A step that overflows
    is the :class:`~qkv.explain.examples.WorkedExampleError` :func:`~qkv.explain.examples.run` raises."""
    if not examples.is_large(worked):
        return np.asarray(examples.run(worked)["weights"].array)
    L = worked.n_queries
    got: dict = {}

    def keep(name, array, row0):
        a = np.asarray(array)
        if a.dtype.kind == "f" and "bad" not in got:                  # as run()'s check: ±inf or NaN (−∞ masked)
            if (np.isnan(a) | (np.isposinf(a) if name == "masked" else np.isinf(a))).any():
                got["bad"] = name
        if name == "weights":
            if "out" not in got:
                got["out"] = np.empty(a.shape[:-2] + (L, a.shape[-1]), np.float32)
            got["out"][..., row0:row0 + a.shape[-2], :] = a
        return array

    examples.run_rows(worked, [0], substitute=keep, block_cells=BLOCK_CELLS)
    if "bad" in got:                                                  # again, checked: the error names the step
        examples.run_rows(worked, [0])
        raise examples.WorkedExampleError(f"{worked.name or 'worked example'}: {got['bad']} overflowed; expected "
                                          "finite numbers — scale the inputs down")
    return got["out"]
