"""Re-launching a command through torchrun for ``--nproc N`` (shared by verify and predict).

``spconv-train verify CONFIG --nproc 2`` run from a plain shell starts
``python -m torch.distributed.run --standalone --nproc-per-node 2 -m spconv_train verify ...``
(torchrun itself, with a free rendezvous port) and returns its exit code. This module
imports no torch, so ``--help`` stays fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["CHILD_ENV", "launched_by_torchrun", "torchrun_argv", "run_torchrun"]

#: Set in the workers started by ``run_torchrun`` so they know a parent reads their result.
CHILD_ENV = "SPCONV_LAUNCHED_BY_PARENT"


def launched_by_torchrun() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets ``RANK``)."""
    return "RANK" in os.environ


def torchrun_argv(
    nproc: int, command: str, args: Sequence[str], launcher: str = "torch.distributed.run"
) -> list[str]:
    """The torchrun command line running ``spconv-train COMMAND ARGS`` on ``nproc`` ranks
    (``launcher``: the module that takes torchrun's arguments).

    ``--standalone`` picks a free local rendezvous port, so several jobs (or tests) can run
    side by side on one machine.
    """
    return [
        sys.executable,
        "-m",
        launcher,
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "spconv_train",
        command,
        *map(str, args),
    ]


def run_torchrun(
    nproc: int,
    command: str,
    args: Sequence[str],
    env: dict | None = None,
    launcher: str = "torch.distributed.run",
) -> int:
    """Run ``spconv-train COMMAND ARGS`` under torchrun (through ``launcher``) on ``nproc``
    local ranks; return its exit code (torchrun exits 1 if any worker failed). Workers
    inherit stdout/stderr, so rank 0's output appears as if the command had run here."""
    full_env = {**os.environ, CHILD_ENV: "1", **(env or {})}
    # torchrun would set OMP_NUM_THREADS=1 with a warning; choose a fair share ourselves.
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
    try:
        argv = torchrun_argv(nproc, command, args, launcher)
        return subprocess.run(argv, env=full_env).returncode
    except KeyboardInterrupt:
        return 130
