"""Shared test settings: fixed seeds, hypothesis profile, dtype tolerances."""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("qkv", max_examples=int(os.environ.get("QKV_HYPOTHESIS_EXAMPLES", "60")),
                          deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("qkv")

from qkv_tolerances import TOL  # noqa: E402,F401  (the dtype tolerances: tests import them from there)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def numpy_kernels(monkeypatch):
    """The engine on NumPy's passes alone (no fused numba kernels): for tests of those passes."""
    from qkv.kernels import KERNELS
    monkeypatch.setattr(KERNELS, "choice", "numpy")
    return KERNELS
