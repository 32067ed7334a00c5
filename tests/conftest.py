"""Shared fixtures: the multi-process worker pool (see ``dist_harness.py``)."""

from __future__ import annotations

import pytest

from tests.dist_harness import DistPool


@pytest.fixture(scope="package")  # tests/ is one package: one pool for the whole run
def dist_pool():
    """Spawned gloo worker groups, one per world size, shared by the whole test run."""
    pool = DistPool()
    yield pool
    pool.close()


def pytest_collection_modifyitems(items):
    """Mark every test on the shared worker groups ``dist`` (``-m 'not dist and not e2e'``
    keeps the single-process unit tests)."""
    for item in items:
        if "dist_pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.dist)
