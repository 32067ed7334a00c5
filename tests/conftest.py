"""Shared fixtures: the multi-process worker pool (see ``dist_harness.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.background_jobs import BackgroundJobs, job, wanted
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


#: steps of the uninterrupted reference run
REFERENCE_STEPS = 8
#: the command-line options that stretch the tiny config to the reference run's length
REFERENCE = ("--set", f"training.steps={REFERENCE_STEPS}")


@job("uninterrupted_run")
def _uninterrupted(folder: Path) -> Path:
    """The run folder of one uninterrupted ``torchrun`` job (2 ranks) of the tiny config of
    ``tests/test_train_e2e.py`` stretched to ``REFERENCE_STEPS`` steps (validation and a
    checkpoint every 2 steps): its artifacts are checked in ``test_train_e2e.py``, and its
    parameters and losses are what the interrupted, resumed and restarted jobs there and
    in ``test_faults_e2e.py`` / ``test_multinode_e2e.py`` must end with (checkpointing and
    validation do not change them: several of those jobs run without either)."""
    from tests.processes import torchrun
    from tests.test_train_e2e import ok, tiny_config

    ok(torchrun(tiny_config(folder), *REFERENCE))
    return folder / "run"


_SELECTED = pytest.StashKey[list]()


class _Selected:
    """Keeps the tests left after ``-m`` / ``-k`` deselection (``trylast``: after it): their
    background jobs start with the first of them."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        config.stash[_SELECTED] = list(items)


def pytest_configure(config) -> None:
    config.pluginmanager.register(_Selected())


@pytest.fixture(scope="package", autouse=True)
def background_jobs(request, tmp_path_factory):
    """The process jobs of the selected e2e tests, started in the background with the first
    test (``tests/background_jobs.py``)."""
    jobs = BackgroundJobs(wanted(request.config.stash[_SELECTED]), tmp_path_factory.mktemp)
    yield jobs
    jobs.close()


@pytest.fixture(scope="package")
def uninterrupted_run(background_jobs) -> Path:
    """The run folder of the uninterrupted reference job (``_uninterrupted``)."""
    return background_jobs.result("uninterrupted_run")
