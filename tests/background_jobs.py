"""Process jobs of the end-to-end tests, run in the background while other tests run.

A ``torchrun`` job on 2 cores keeps about one core busy (its agent's start-up, the
workers' imports and teardown run on one core, a tiny model's steps wait on each other),
and so do many of the suite's other tests; the e2e jobs therefore start in the background
with the first test of the run, at most ``PARALLEL`` at a time, while the other tests run,
and each e2e test waits for its own job's result and makes its assertions on it.

A job is a function ``fn(folder) -> result`` registered with ``@job(name)`` in the module
of its test; it launches its processes (``launch`` / ``Job`` with explicit environments:
jobs run in threads, so none may change ``os.environ``) and returns what the test checks.
Its processes get the environment of the moment the jobs started (``environ()``), not the
temporary variables of whichever test runs meanwhile. A test declares its jobs with
``@pytest.mark.job(name)`` (or by using a fixture of the job's name) and reads them with
``background_jobs.result(name)``; only the jobs of the selected tests run, in the order of
those tests. A job that fails (e.g. ``pytest.fail`` in a wait) raises in its test.
``exclusive`` jobs run when their test asks, in its thread, with no background job running
(the watchdog test's 4 s timeout must not measure a busy machine).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

#: background jobs at once (each ``torchrun`` job is an agent and its workers)
PARALLEL = int(os.environ.get("SPCONV_TEST_JOBS", "2"))


@dataclass(frozen=True)
class Spec:
    """A registered job: ``fn(folder)`` and whether it must run alone."""

    name: str
    fn: Callable[[Path], object]
    exclusive: bool = False


JOBS: dict[str, Spec] = {}
_LOCAL = threading.local()


def environ() -> dict[str, str]:
    """The environment for a launched process: in a background job, ``os.environ`` as it
    was when the jobs started; elsewhere ``os.environ`` now."""
    return dict(getattr(_LOCAL, "environ", os.environ))


def job(name: str, exclusive: bool = False):
    """Register ``fn(folder) -> result`` as the background job ``name``."""

    def register(fn: Callable[[Path], object]) -> Callable[[Path], object]:
        if name in JOBS and JOBS[name].fn is not fn:
            raise ValueError(f"two background jobs named {name!r}")
        JOBS[name] = Spec(name, fn, exclusive)
        return fn

    return register


def wanted(items) -> list[str]:
    """The names of the jobs the selected test ``items`` use, in the order of first use
    (a ``job`` marker, or a fixture of the job's name)."""
    names: list[str] = []
    for item in items:
        marks = [m.args[0] for m in item.iter_markers("job")]
        for name in [*marks, *getattr(item, "fixturenames", ())]:
            if name in JOBS and name not in names:
                names.append(name)
    return names


class BackgroundJobs:
    """Runs the given jobs in order, ``parallel`` at a time, each in a folder made by
    ``mkdir(name)``; ``result(name)`` waits for one. An ``exclusive`` job is not queued:
    ``result`` runs it in the caller's thread once the running jobs have ended, and no
    other job starts meanwhile."""

    def __init__(self, names: list[str], mkdir: Callable[[str], Path], parallel: int = PARALLEL):
        self._specs = {n: JOBS[n] for n in names}
        self._futures: dict[str, Future] = {n: Future() for n in names}
        self._mkdir = mkdir
        self._environ = dict(os.environ)  # before any test's monkeypatch of this test
        self._parallel = max(1, parallel)
        self._slots = threading.Semaphore(self._parallel)
        self._gate = threading.Lock()  # held while a job is being started (or runs alone)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        queued = [spec for spec in self._specs.values() if not spec.exclusive]
        self._dispatcher = threading.Thread(
            target=self._dispatch, args=(queued,), name="e2e-jobs", daemon=True
        )
        self._dispatcher.start()

    def _dispatch(self, queued: list[Spec]) -> None:
        for spec in queued:
            with self._gate:
                self._slots.acquire()
                future = self._futures[spec.name]
                if self._stop.is_set() or not future.set_running_or_notify_cancel():
                    self._slots.release()
                    continue
                thread = threading.Thread(
                    target=self._run, args=(spec, future), name=f"job-{spec.name}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _run(self, spec: Spec, future: Future) -> None:
        try:
            self._call(spec, future)
        finally:
            self._slots.release()

    def _call(self, spec: Spec, future: Future) -> None:
        _LOCAL.environ = self._environ
        try:
            future.set_result(spec.fn(self._mkdir(spec.name)))
        except BaseException as error:  # noqa: BLE001 - pytest.fail too: raised in the test
            future.set_exception(error)
        finally:
            del _LOCAL.environ

    def _run_alone(self, spec: Spec, future: Future) -> None:
        with self._gate:  # no job starts now
            for _ in range(self._parallel):  # the running ones end
                self._slots.acquire()
            try:
                if future.set_running_or_notify_cancel():
                    self._call(spec, future)
            finally:
                self._slots.release(self._parallel)

    def result(self, name: str):
        """The return value of job ``name`` (waits for it; raises what the job raised)."""
        if name not in self._futures:
            raise KeyError(f"background job {name!r} was not started (no selected test uses it)")
        future = self._futures[name]
        if self._specs[name].exclusive and not future.done():
            self._run_alone(self._specs[name], future)
        return future.result()

    def close(self) -> None:
        """Start no more jobs; wait for the running ones (each is bounded by its own
        timeouts)."""
        self._stop.set()
        for future in self._futures.values():
            future.cancel()
        self._dispatcher.join()
        for thread in self._threads:
            thread.join()
