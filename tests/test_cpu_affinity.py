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
from spconv_train.distributed.cpu_affinity import bind_local_rank
from spconv_train.distributed import free_port
from spconv_train.parallel._comm_threads import gloo_thread_ids

share = bind_local_rank(int(sys.argv[1]), int(sys.argv[2]))
seen = {}
t = threading.Thread(target=lambda: seen.update(later=sorted(os.sched_getaffinity(0))))
t.start(); t.join()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                        world_size=1, timeout=timedelta(seconds=60))
gloo = sorted({c for tid in gloo_thread_ids() for c in os.sched_getaffinity(tid)})
dist.destroy_process_group()
print(json.dumps({"share": share, "main": sorted(os.sched_getaffinity(0)),
                  "later": seen["later"], "gloo": gloo, "n_gloo": len(gloo_thread_ids())}))
"""


def _child(rank: int, world: int, **env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(rank), str(world)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_binding_covers_every_thread_and_gloo():
    allowed = sorted(os.sched_getaffinity(0))
    world = min(len(allowed), 2)
    if world < 2:
        pytest.skip("one core: nothing to split")
    got = _child(world - 1, world)
    want = local_share(world - 1, world, allowed)
    assert got["share"] == want
    assert got["main"] == want and got["later"] == want
    assert got["gloo"] == want  # the group's threads, started after the binding, inherit it


def test_opt_out_leaves_the_affinity():
    got = _child(0, 2, SPCONV_CPU_AFFINITY="0")
    allowed = sorted(os.sched_getaffinity(0))
    assert got["share"] is None
    assert got["main"] == got["later"] == allowed
