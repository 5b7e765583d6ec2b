"""Every test under tests/integration is an integration test: it needs torch, transformers, a model package
(MiniLM, SmolLM2, their readers) or Chromium. ``make test`` runs them; ``make check`` runs tests/unit alone."""
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
