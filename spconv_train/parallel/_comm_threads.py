"""gloo's helper threads at ``SCHED_IDLE`` (no privilege needed), so they never take a core
from a rank's compute thread (gloo's socket loop spins on busy cores): docs/design.md, "CPU
runs"; docs/benchmarks.md, "CPU thread placement". Thread names: a torch 2.14.1 internal.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import time
from collections.abc import Iterator

ENV = "SPCONV_GLOO_THREADS"
#: ``/proc/<pid>/task/<tid>/comm`` prefixes of gloo's loop thread and ProcessGroupGloo's
#: collective workers (``gloo_tcp_loop``, ``pt_gloo_runloop``).
GLOO_THREAD_PREFIXES = ("gloo", "pt_gloo")
#: How long ``gloo_threads_idle`` waits for a thread started in its block to name itself (a
#: thread that never does, e.g. an OpenMP worker, costs this once).
NAMING_WAIT_S = 1.0
_TASKS = "/proc/self/task"


def _thread_names() -> dict[int, str]:
    """``{thread id: name}`` of this process's threads (empty off Linux)."""
    names = {}
    for tid in os.listdir(_TASKS) if os.path.isdir(_TASKS) else ():
        with contextlib.suppress(OSError), open(f"{_TASKS}/{tid}/comm") as f:  # OSError: ended
            names[int(tid)] = f.read().strip()
    return names


def gloo_thread_ids() -> list[int]:
    """Thread ids of this process's gloo helper threads (empty off Linux)."""
    names = _thread_names().items()
    return sorted(t for t, n in names if n.startswith(GLOO_THREAD_PREFIXES) and t != os.getpid())


def _disabled() -> bool:
    off = ("normal", "0", "off", "no", "false")
    return os.environ.get(ENV, "idle").strip().lower() in off or not hasattr(os, "SCHED_IDLE")


def _set_policy(policy: int, only_from: int | None = None) -> int:
    """Give ``policy`` to the gloo threads (those with ``only_from``); how many it saw."""
    done = 0
    for tid in gloo_thread_ids():
        with contextlib.suppress(OSError):  # ended meanwhile, or a sandbox that forbids it
            now = os.sched_getscheduler(tid)
            if now != policy and only_from in (None, now):
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            done += 1
    return done


def yield_gloo_threads() -> int:
    """Give this process's gloo threads ``SCHED_IDLE``; how many have it (0 off Linux or
    with ``SPCONV_GLOO_THREADS=normal``)."""
    return 0 if _disabled() else _set_policy(os.SCHED_IDLE)


def restore_gloo_threads() -> None:
    """Give gloo's threads the normal policy back before the groups are torn down: a worker
    still releasing a collective at finalization aborts (``distributed.shutdown``)."""
    if hasattr(os, "SCHED_IDLE"):  # Linux only
        _set_policy(os.SCHED_OTHER, only_from=os.SCHED_IDLE)


@contextlib.contextmanager
def gloo_threads_idle() -> Iterator[None]:
    """Run a block that creates process groups; afterwards every gloo thread has
    ``SCHED_IDLE``, those it started given up to ``NAMING_WAIT_S`` to name themselves."""
    before = set(_thread_names())
    yield
    if _disabled():
        return
    deadline, me = time.monotonic() + NAMING_WAIT_S, os.getpid()
    own = _thread_names().get(me)
    while time.monotonic() < deadline:  # until no new thread still bears the process's name
        names = _thread_names()
        if not any(names[t] == own for t in set(names) - before - {me}):
            break
        time.sleep(0.001)
    if yield_gloo_threads():
        _restore_at_exit()


@functools.cache  # once per process
def _restore_at_exit() -> None:
    atexit.register(restore_gloo_threads)
