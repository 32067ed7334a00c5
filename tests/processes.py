"""Processes of the end-to-end tests: ``launch`` a command (its own process group, killed
whole on a timeout), ``torchrun`` the training command, put a ``sitecustomize`` hook on
the launched processes' path (``hook_env``). Environments are passed explicitly
(``launch_env``): the background jobs (``tests/background_jobs.py``) run in threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.background_jobs import environ

REPO = Path(__file__).resolve().parents[1]


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched process: this one's, one thread, ``extra`` on top."""
    env = {**environ(), "OMP_NUM_THREADS": "1", "SPCONV_TIMEOUT_S": "120"}
    return {**env, **(extra or {})}


def hook_env(folder: Path, hook: str) -> dict[str, str]:
    """Write ``hook`` as ``folder/hook/sitecustomize.py``; the environment variables that
    put it on the launched processes' ``PYTHONPATH`` (pass them as ``env``)."""
    (folder / "hook").mkdir()
    (folder / "hook" / "sitecustomize.py").write_text(hook)
    path = os.pathsep.join(filter(None, [str(folder / "hook"), environ().get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


def launch(
    cmd: list[str], timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (with the variables ``env`` added to the environment) in its own process
    group; on a timeout kill the whole group (torchrun's workers too, which would otherwise
    outlive it) and fail."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=launch_env(env),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {cmd}\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(
    *args: object, nproc: int = 2, restarts: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m spconv_train run ARGS`` (as ``make run`` does)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += [f"--max-restarts={restarts}", "-m", "spconv_train", "run", *map(str, args)]
    return launch(cmd, env=env)
