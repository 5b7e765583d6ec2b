"""Shared test settings: fixed seeds, hypothesis profile, dtype tolerances, the `slow` tier."""
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


#: ``make check`` runs ``pytest -m "not slow"`` (under 90 s on 2 cores); ``make test`` runs everything. Marked
#: slow: the browser tests, tests that load a model or need a GPU, and these files (each ~10 s or more on
#: 2 cores, or end-to-end runs of the command line, the benchmarks, ring attention, the page, subprocesses).
SLOW_FILES = frozenset({
    "test_bench.py", "test_bench_accuracy.py", "test_kernels.py", "test_lab.py", "test_notebook.py",
    "test_distributed.py", "test_distributed_failure.py", "test_plain_loop.py", "test_matrix.py",
    "test_matrix_findings.py", "test_models.py", "test_models_cli.py", "test_models_reference.py", "test_llama.py",
    "test_llama_reference.py", "test_heatmap_memory.py", "test_viz_scale.py", "test_viz_page.py", "test_viz_cli.py",
    "test_tiled_flex.py", "test_cli_robust.py", "test_docs.py", "test_hostile_files.py", "test_chat_template.py",
    "test_cli_counts.py", "test_cli_bad_input2.py", "test_optional_extras.py", "test_hf.py", "test_torch_autograd.py",
})
#: Single tests as slow ("file::function"): the sweeps against torch (test_flex: 639 cases, ~3 minutes of CPU).
SLOW_TESTS = frozenset({"test_flex.py::test_forward_matches_torch", "test_flex.py::test_backward_matches_torch_autograd"})
SLOW_MARKS = ("model", "browser", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.path.name in SLOW_FILES or f"{item.path.name}::{item.originalname}" in SLOW_TESTS
                or "browser" in item.path.parts or any(item.get_closest_marker(m) for m in SLOW_MARKS)):
            item.add_marker(pytest.mark.slow)
