"""Absolute/relative tolerances per dtype, for comparisons against torch computed in the same dtype.

A module of its own (not ``conftest``): with conftest files in tests/ and tests/integration/browser/, ``import conftest``
finds whichever was imported first.
"""
import numpy as np

TOL = {np.float16: dict(atol=3e-3, rtol=3e-3), np.float32: dict(atol=2e-5, rtol=2e-5),
       np.float64: dict(atol=1e-10, rtol=1e-10)}
