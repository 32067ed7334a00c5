"""gloo's helper threads run with SCHED_IDLE (spconv_train/parallel/_comm_threads.py): found
by name in real gloo process groups, lowered by the run's mesh set-up (``build_mesh``) also
for the groups the mesh creates, never the main thread, and the exchanges still work."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from spconv_train.parallel import _comm_threads as ct

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
    reason="SCHED_IDLE and /proc are Linux's",
)


def _policies() -> dict[int, int]:
    return {tid: os.sched_getscheduler(tid) for tid in ct.gloo_thread_ids()}


def mesh_lowers_new_groups(world: int) -> dict:
    from spconv_train.distributed import build_mesh

    # A fresh group starts its own loop and worker threads at the normal policy.
    before = set(ct.gloo_thread_ids())
    os.environ[ct.ENV] = "normal"  # the mesh below must find threads still normal
    try:
        extra = dist.new_group(list(range(world)))
        dist.barrier(group=extra)
    finally:
        del os.environ[ct.ENV]
    fresh = set(ct.gloo_thread_ids()) - before
    fresh_normal = all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in fresh)
    mesh = build_mesh(1, world, "cpu")  # what `spconv-train run` does after init
    policies = _policies()
    # The exchange still completes with every helper thread idle-only.
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=mesh.get_group("sp"))
    return {
        "fresh": len(fresh),
        "fresh_normal": fresh_normal,
        "threads": len(policies),
        "all_idle": all(p == os.SCHED_IDLE for p in policies.values()),
        "main": os.sched_getscheduler(0),
        "sum": t.tolist(),
    }


@pytest.mark.parametrize("world", [2])
def test_build_mesh_makes_every_gloo_thread_idle(dist_pool, world):
    for r in dist_pool.run(world, mesh_lowers_new_groups, world):
        assert r["fresh"] >= 1 and r["fresh_normal"], r  # gloo still names its threads
        assert r["threads"] >= 3 and r["all_idle"], r
        assert r["main"] == os.SCHED_OTHER, r
        assert r["sum"] == [3.0] * 4


def test_opt_out_and_other_threads_untouched(monkeypatch):
    ready, stop = threading.Event(), threading.Event()
    tid = {}

    def named():  # a thread named as gloo names its threads: matched by that name
        import ctypes

        ctypes.CDLL(None).prctl(15, b"gloo_fake")  # PR_SET_NAME: this thread's comm
        tid["fake"] = threading.get_native_id()
        ready.set()
        stop.wait(10)

    th = threading.Thread(target=named, daemon=True)
    th.start()
    ready.wait(10)
    try:
        fake = tid["fake"]
        assert fake in ct.gloo_thread_ids()
        monkeypatch.setenv(ct.ENV, "normal")
        assert ct.yield_gloo_threads() == 0
        assert os.sched_getscheduler(fake) == os.SCHED_OTHER
        monkeypatch.delenv(ct.ENV)
        assert ct.yield_gloo_threads() == len(ct.gloo_thread_ids()) >= 1
        assert os.sched_getscheduler(fake) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the main thread is never touched
    finally:
        stop.set()
        th.join(10)


def test_a_thread_named_late_is_still_made_idle():
    """gloo's threads name themselves once they run: one started inside the block and named
    only after the block's code returned is still found (the race the suite once hit)."""
    ready, stop = threading.Event(), threading.Event()
    tid = {}

    def late():
        import ctypes

        tid["late"] = threading.get_native_id()
        ready.wait(10)  # named only after the block's own code is done
        time.sleep(0.02)
        ctypes.CDLL(None).prctl(15, b"pt_gloo_late")
        stop.wait(10)

    th = threading.Thread(target=late, daemon=True)
    try:
        with ct.gloo_threads_idle():
            th.start()
            ready.set()
        assert os.sched_getscheduler(tid["late"]) == os.SCHED_IDLE
    finally:
        stop.set()
        th.join(10)
