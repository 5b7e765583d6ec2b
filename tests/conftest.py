"""Shared test settings: fixed seeds, hypothesis profile, dtype tolerances.

The tests live in two folders: ``tests/unit`` needs NumPy, numba and the command line's extras alone (``make
check``, under 90 s on 2 cores, leaves out the files marked ``slow`` at their top); ``tests/integration`` needs
torch, transformers, a model package or Chromium (its conftest marks every test in it ``integration``). The helpers
both folders import (``cli_checks``, ``matrix_families``, ``qkv_tolerances``) and ``data/`` stay here, beside this
file, which puts this folder (and the two) on ``sys.path``."""
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

#: The shared helpers, from either folder; and each folder, for the test modules that import another's helpers
#: by module name (tests/integration/browser's from tests/integration/test_viz_hf.py): module names are unique across folders.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in ("integration", "unit", ""):
    if os.path.join(_HERE, _folder).rstrip(os.sep) not in sys.path:
        sys.path.insert(0, os.path.join(_HERE, _folder).rstrip(os.sep))

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
