"""Shared test settings: fixed seeds, hypothesis profile, dtype tolerances."""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("qkv", max_examples=int(os.environ.get("QKV_HYPOTHESIS_EXAMPLES", "60")),
                          deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("qkv")

# Absolute/relative tolerances per dtype, for comparisons against torch computed in the same dtype.
TOL = {np.float16: dict(atol=3e-3, rtol=3e-3), np.float32: dict(atol=2e-5, rtol=2e-5),
       np.float64: dict(atol=1e-10, rtol=1e-10)}


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
