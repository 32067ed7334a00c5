"""End to end: a two-node job (two torchrun agents on 127.0.0.1, c10d rendezvous) restarts
after one worker is killed and resumes on the first restart, on both nodes.

torchrun counts restarts per node: the node whose worker died restarts with
``TORCHELASTIC_RESTART_COUNT=1``, the healthy node's agent restarts its worker for the new
rendezvous round with the count still 0. Both must follow the job's recorded decision
(resume) and meet in one process group; the run then ends with the parameters of an
uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spconv_train.distributed import free_port
from tests.background_jobs import job
from tests.conftest import REFERENCE_STEPS
from tests.test_faults_e2e import Job, hooked
from tests.test_train_e2e import exported, tiny_config

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

STEPS = ("--set", f"training.steps={REFERENCE_STEPS}", "--set", "checkpoint.every=2")
STEPS += ("--set", "training.val_every=100")


def node_cmd(config: Path, endpoint: str, *args: str) -> list[str]:
    """One node's agent of a 2-node, 1-worker-per-node job (c10d, one restart allowed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=spconv-2nodes"]
    cmd += ["--local-addr=127.0.0.1", "--max-restarts=1"]
    return [*cmd, "-m", "spconv_train", "run", str(config), *args]


@job("two_nodes")
def _two_nodes_job(folder: Path) -> tuple[list[subprocess.CompletedProcess], Path]:
    """Both nodes' agents; node 1's worker killed after step 3. Their results, the run."""
    config, run_dir = tiny_config(folder), folder / "run"
    env = hooked(folder, SPCONV_TEST_STEP_DELAY="0.3")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    try:
        for name in ("node0", "node1"):
            (folder / name).mkdir()
            nodes.append(Job(node_cmd(config, endpoint, *STEPS), folder / name, env))
        nodes[0].wait_for_step(run_dir, 3)
        os.kill(nodes[1].worker(), signal.SIGKILL)
        return [node.finish(timeout=240) for node in nodes], run_dir
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.job("two_nodes")
def test_two_nodes_resume_on_the_first_restart_after_a_worker_is_killed(
    background_jobs, uninterrupted_run
):
    procs, run_dir = background_jobs.result("two_nodes")
    out = "\n".join(p.stdout + p.stderr for p in procs)
    assert [p.returncode for p in procs] == [0, 0], out[-6000:]
    assert "already holds a run" not in out, out[-6000:]
    # The killed worker failed; the other node's worker either was restarted by its agent
    # or stopped first on the lost connection (exit 1, which way depends on where it
    # waited); no restarted worker refused and used up its node's restart; the restart
    # resumed the job's checkpoint.
    codes = re.findall(r"failed \(exitcode: (-?\d+)\)", out)
    assert sorted(codes) in (["-9"], ["-9", "1"]), out[-6000:]
    if "1" in codes:
        assert "lost the connection to another rank, which failed first" in out, out[-6000:]
    assert "torchrun restart" in out and "resuming (this job started as fresh)" in out
    assert re.search(r"resumed\s+from", out), out[-6000:]
    want, got = exported(uninterrupted_run), exported(run_dir)  # one node, 2 workers
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
