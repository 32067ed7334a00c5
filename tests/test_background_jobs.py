"""The background job runner of the e2e tests (``tests/background_jobs.py``): results and
failures reach the test that asks, at most ``parallel`` jobs run at once, an exclusive job
runs alone in the asking thread, and a job sees the environment of the moment the jobs
started."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.background_jobs import JOBS, BackgroundJobs, Spec, environ

RUNNING: list[str] = []
MOST = [0]
LOCK = threading.Lock()


def _tracked(name: str, value: object = None, fail: bool = False):
    def fn(folder: Path):
        with LOCK:
            RUNNING.append(name)
            MOST[0] = max(MOST[0], len(RUNNING))
            beside = [n for n in RUNNING if n != name]
        time.sleep(0.2)
        with LOCK:
            RUNNING.remove(name)
        if fail:
            pytest.fail(f"{name} failed in {folder.name}")
        probe = environ().get("SPCONV_BG_PROBE")
        return value, threading.current_thread().name, probe, beside

    return fn


@pytest.fixture
def registry(monkeypatch):
    """Five test jobs in place of the suite's (restored afterwards)."""
    specs = {f"j{i}": Spec(f"j{i}", _tracked(f"j{i}", i)) for i in range(4)}
    specs["bad"] = Spec("bad", _tracked("bad", fail=True))
    specs["alone"] = Spec("alone", _tracked("alone", "solo"), exclusive=True)
    monkeypatch.setattr("tests.background_jobs.JOBS", specs)
    MOST[0] = 0
    return specs


def test_results_failures_parallelism_and_exclusive_job(registry, tmp_path, monkeypatch):
    monkeypatch.setenv("SPCONV_BG_PROBE", "at start")
    jobs = BackgroundJobs(["j0", "j1", "bad", "j2", "alone", "j3"], tmp_path.joinpath, 2)
    monkeypatch.setenv("SPCONV_BG_PROBE", "changed by a test meanwhile")
    try:
        assert jobs.result("j2")[0] == 2
        assert [jobs.result(f"j{i}")[0] for i in range(4)] == [0, 1, 2, 3]
        assert all(jobs.result(f"j{i}")[1] == f"job-j{i}" for i in range(4))
        assert jobs.result("j0")[2] == "at start"  # not the later monkeypatch
        with pytest.raises(pytest.fail.Exception, match="bad failed in bad"):
            jobs.result("bad")
        value, thread, _, beside = jobs.result("alone")
        assert (value, thread, beside) == ("solo", threading.current_thread().name, [])
        assert MOST[0] == 2
        with pytest.raises(KeyError, match="not started"):
            jobs.result("j9")
    finally:
        jobs.close()
    assert os.environ["SPCONV_BG_PROBE"] == "changed by a test meanwhile"


def test_close_cancels_jobs_not_started(registry, tmp_path):
    jobs = BackgroundJobs(["j0", "j1", "j2", "j3"], tmp_path.joinpath, 1)
    jobs.close()
    assert jobs._futures["j0"].done() and jobs._futures["j3"].cancelled()


def test_the_suite_registers_its_jobs():
    import tests.test_faults_e2e
    import tests.test_gpu_check
    import tests.test_multinode_e2e
    import tests.test_run_folder
    import tests.test_train_e2e
    import tests.test_verify  # noqa: F401 - each registers its jobs

    names = {"uninterrupted_run", "fault_data_rank1", "fault_config_rank1", "watchdog"}
    names |= {"sigterm_one_rank", "sigterm_plain", "two_nodes", "gpu_check_cpu"}
    names |= {"torchrun_restart", "too_narrow", "refused_folder", "verify_torchrun"}
    assert set(JOBS) == names
    assert [n for n, spec in JOBS.items() if spec.exclusive] == ["watchdog"]
