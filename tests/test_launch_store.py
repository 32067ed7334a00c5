"""Restarts on several nodes (``spconv_train.distributed.launch_store``, ``run_folder``),
in-process.

torchrun counts restarts per node: after one worker fails, the healthy node's restarted
workers still see ``TORCHELASTIC_RESTART_COUNT=0``. What tells a restart of the job from a
new job is the launch-long store (``launch_recorded``), and the process group of an attempt
gets a prefix every rank agrees on whatever the earlier attempts left in the store
(``join_attempt``). The two-node run itself is ``tests/test_multinode_e2e.py``.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from spconv_train.config import ConfigError, dump_config, load_config
from spconv_train.distributed import free_port
from spconv_train.distributed.launch_store import join_attempt, launch_recorded, mark_recorded
from spconv_train.logging.run_folder import JobRecord, plan_start, write_job

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = timedelta(seconds=30)


def _folder_of_a_job(run_dir: Path, job: str) -> None:
    """What the first attempt of ``job`` left: its record, config and a checkpoint."""
    cfg = load_config(REPO / "configs" / "unet.yaml", [f"run_dir={run_dir}"])
    (run_dir / "checkpoints" / "step-000002").mkdir(parents=True)
    dump_config(cfg, run_dir / "config.yaml")
    write_job(run_dir, JobRecord(job=job, decision="fresh", attempt=0))


def _plan(run_dir: Path, *, restarts: int, recorded: bool | None, policy: str = "auto"):
    cfg = load_config(
        REPO / "configs" / "unet.yaml", [f"run_dir={run_dir}", f"checkpoint.resume={policy}"]
    )
    return plan_start(
        cfg, resume=False, overwrite=False, restarts=restarts, job="rdzv-1", recorded=recorded
    )


@pytest.mark.parametrize("policy", ["auto", "never"])
def test_every_node_of_a_restarted_launch_follows_the_record(tmp_path, policy):
    """The healthy node (count 0) and the failed node (count 1) of the same launch both
    take the job's decision: resume (before: the healthy node refused with exit 2)."""
    _folder_of_a_job(tmp_path, "rdzv-1")
    for restarts in (0, 1):
        plan = _plan(tmp_path, restarts=restarts, recorded=True, policy=policy)
        assert plan.resume or policy == "never", plan
        assert plan.record.decision == "fresh" and plan.record.attempt == restarts
    assert (
        "torchrun restart (new round): resuming"
        in _plan(tmp_path, restarts=0, recorded=True).notes[0]
    )


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_new_launch_with_the_same_run_id_is_a_new_job(tmp_path, restarts):
    """The store of a new launch has no mark: the crashed launch's record (same
    ``--rdzv-id``) is not its own on any attempt, so the folder is refused, not continued
    or (``never``) deleted."""
    _folder_of_a_job(tmp_path, "rdzv-1")
    for policy in ("auto", "never"):
        with pytest.raises(ConfigError, match="already holds a run"):
            _plan(tmp_path, restarts=restarts, recorded=False, policy=policy)


def test_without_a_launch_store_the_restart_count_decides(tmp_path):
    _folder_of_a_job(tmp_path, "rdzv-1")
    assert _plan(tmp_path, restarts=1, recorded=None).resume
    with pytest.raises(ConfigError):
        _plan(tmp_path, restarts=0, recorded=None)


@pytest.fixture
def agent_store(monkeypatch):
    """A store hosted as torchrun's agent hosts it, and the workers' environment."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=TIMEOUT)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr("spconv_train.distributed.launch_store._store", None)
    yield port
    del server


def test_launch_mark(agent_store):
    assert launch_recorded("rdzv-1") is False
    mark_recorded("rdzv-1")
    assert launch_recorded("rdzv-1") is True
    assert launch_recorded("another-job") is False
    assert launch_recorded("") is None  # no run id: never a restart


def _join_all(port: int, world: int) -> list[str]:
    """``join_attempt`` on ranks 0..world-1 at once, each with its own store client."""
    prefixes = [""] * world

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        prefixes[r] = join_attempt(client, r, world, TIMEOUT)

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return prefixes


def test_attempts_agree_on_a_fresh_prefix_whatever_earlier_attempts_left(agent_store):
    """Attempt 1 completes; attempt 2's rank 2 dies after announcing itself (its token
    stays in the store); attempt 3 must still agree on one new prefix on every rank."""
    first = _join_all(agent_store, 3)
    assert len(set(first)) == 1 and first[0]
    client = dist.TCPStore("127.0.0.1", agent_store, is_master=False, timeout=TIMEOUT)
    client.set("spconv_train/launch/join/2", "token-of-a-dead-worker")
    third = _join_all(agent_store, 3)
    assert len(set(third)) == 1 and third[0] not in ("", first[0])
