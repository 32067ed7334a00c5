"""Each local rank of a CPU run bound to its own share of the allowed cores
(spconv_train/distributed/cpu_affinity.py): the split, and a real process whose main
thread, a thread started later and a gloo process group's threads all end up on the share (run in a
subprocess: binding the test process would bind every worker it spawns after)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spconv_train.distributed.cpu_affinity import local_share

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's"
)


@pytest.mark.parametrize(
    ("rank", "world", "cores", "want"),
    [
        (0, 2, [0, 1], [0]),
        (1, 2, [1, 0], [1]),
        (1, 2, [4, 5, 6, 7, 9], [6, 7]),  # two cores each, the fifth unused
        (2, 3, [2, 3, 5, 8, 13, 21], [13, 21]),
        (0, 3, [0, 1], None),  # fewer cores than local ranks: they share anyway
        (0, 1, [0, 1, 2], None),  # one local rank: nothing to split
        (2, 2, [0, 1], None),  # not a local rank of this world
    ],
)
def test_local_share(rank, world, cores, want):
    assert local_share(rank, world, cores) == want


_CHILD = r"""
import json, os, threading, sys
from datetime import timedelta
import torch.distributed as dist
from spconv_train.distributed.cpu_affinity import ENV, bind_local_rank
from spconv_train.distributed import free_port
from spconv_train.parallel._comm_threads import gloo_thread_ids

rank, world = int(sys.argv[1]), int(sys.argv[2])
def later():
    seen = {}
    t = threading.Thread(target=lambda: seen.update(cores=sorted(os.sched_getaffinity(0))))
    t.start(); t.join()
    return seen["cores"]
os.environ[ENV] = "0"  # opted out first: nothing is bound
out = {"opt_out": {"share": bind_local_rank(rank, world),
                   "main": sorted(os.sched_getaffinity(0)), "later": later()}}
del os.environ[ENV]
share = bind_local_rank(rank, world)
seen = later()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                        world_size=1, timeout=timedelta(seconds=60))
gloo = sorted({c for tid in gloo_thread_ids() for c in os.sched_getaffinity(tid)})
dist.destroy_process_group()
out.update({"share": share, "main": sorted(os.sched_getaffinity(0)), "later": seen,
            "gloo": gloo, "n_gloo": len(gloo_thread_ids())})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child() -> dict:
    """One fresh process as the last local rank of 2 (one core: of 1): its affinity opted
    out (``SPCONV_CPU_AFFINITY=0``), then bound, then a gloo group started."""
    world = min(len(os.sched_getaffinity(0)), 2)
    env = {k: v for k, v in os.environ.items() if k != "SPCONV_CPU_AFFINITY"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(world - 1), str(world)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_binding_covers_every_thread_and_gloo(child):
    allowed = sorted(os.sched_getaffinity(0))
    world = min(len(allowed), 2)
    if world < 2:
        pytest.skip("one core: nothing to split")
    want = local_share(world - 1, world, allowed)
    assert child["share"] == want
    assert child["main"] == want and child["later"] == want
    assert child["gloo"] == want  # the group's threads, started after the binding, inherit it


def test_opt_out_leaves_the_affinity(child):
    allowed = sorted(os.sched_getaffinity(0))
    got = child["opt_out"]
    assert got["share"] is None
    assert got["main"] == got["later"] == allowed
