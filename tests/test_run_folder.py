"""The run folder's start decision is made once per job (``spconv_train.logging.run_folder``).

Unit tests of ``plan_start`` for first attempts and torchrun restarts (with and without the
job record), the record itself, and a real ``torchrun --max-restarts 1`` in a folder holding
another run: every attempt refuses it and the folder is left byte for byte intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spconv_train.config import ConfigError, dump_config, load_config
from spconv_train.logging.run_folder import (
    JOB_FILE,
    RUN_FILES,
    JobRecord,
    finish_job,
    job_id,
    plan_start,
    read_job,
    write_job,
)
from tests.background_jobs import job
from tests.processes import torchrun
from tests.test_train_e2e import tiny_config

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

REPO = Path(__file__).resolve().parents[1]
UNET = REPO / "configs" / "unet.yaml"


def _cfg(run_dir: Path, resume: str = "auto", *sets: str):
    return load_config(UNET, [f"run_dir={run_dir}", f"checkpoint.resume={resume}", *sets])


def _old_run(run_dir: Path, steps: int = 2) -> None:
    """A folder holding a run: config, a (fake) complete checkpoint, metrics, export."""
    ckpt = run_dir / "checkpoints" / f"step-{steps:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": steps}))
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 3)
    (run_dir / "checkpoints" / "latest").write_text(f"step-{steps:06d}\n")
    (run_dir / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 1.25}\n')
    (run_dir / "model.pt").write_bytes(b"old weights \x00\x01\x02")
    dump_config(_cfg(run_dir), run_dir / "config.yaml")


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def plan(run_dir: Path, *, resume=False, overwrite=False, restarts=0, job="job-1", policy="auto"):
    cfg = _cfg(run_dir, policy)
    return plan_start(cfg, resume=resume, overwrite=overwrite, restarts=restarts, job=job)


# --- first attempts -------------------------------------------------------------------------


def test_first_attempt_records_its_decision(tmp_path):
    run_dir = tmp_path / "run"
    fresh = plan(run_dir)
    assert (fresh.resume, fresh.remove) == (False, ())
    assert fresh.record == JobRecord(job="job-1", decision="fresh", attempt=0)
    _old_run(run_dir)
    over = plan(run_dir, overwrite=True)
    assert set(over.remove) == {"config.yaml", "checkpoints", "metrics.jsonl", "model.pt"}
    assert over.record.decision == "overwrite" and not over.resume
    res = plan(run_dir, resume=True)
    assert res.resume and res.remove == () and res.record.decision == "resume"


@pytest.mark.parametrize("policy", ["auto", "never"])
def test_a_new_job_in_a_folder_whose_job_crashed_is_refused(tmp_path, policy):
    """The previous job (another run id) crashed for good: its record does not make the new
    job a restart of it, on the first attempt or on any restart."""
    run_dir = tmp_path / "run"
    _old_run(run_dir)
    write_job(run_dir, JobRecord(job="old-job", decision="fresh", attempt=1))
    for restarts in (0, 1, 3):
        with pytest.raises(ConfigError) as err:
            plan(run_dir, restarts=restarts, job="new-job", policy=policy)
        assert err.value.key == "run_dir" and "--resume" in str(err.value)
    assert "still refused" in str(err.value)
    # Asked explicitly, the new job may take the folder over.
    assert plan(run_dir, resume=True, job="new-job").resume
    assert JOB_FILE in plan(run_dir, overwrite=True, job="new-job").remove


@pytest.mark.parametrize("policy", ["auto", "never"])
def test_a_refused_job_keeps_refusing_on_restarts(tmp_path, policy):
    """The first attempt refused and recorded nothing; a restart must not delete (never) or
    take over (auto) the old run, whatever record the old run left."""
    run_dir = tmp_path / "run"
    _old_run(run_dir)
    for record in (
        None,  # a run of an older version, or a plain (non-torchrun) run
        JobRecord(job="", decision="fresh"),  # a plain run: no run id
        JobRecord(job="job-1", decision="fresh", finished=True),  # same run id, finished
        JobRecord(job="job-1", decision="fresh", attempt=1),  # same run id, not earlier
    ):
        if record is not None:
            write_job(run_dir, record)
        for restarts in (0, 1):
            with pytest.raises(ConfigError):
                plan(run_dir, restarts=restarts, policy=policy)


def test_restart_of_a_fresh_job_that_crashed_before_any_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    first = plan(run_dir)
    run_dir.mkdir()
    write_job(run_dir, first.record)
    dump_config(_cfg(run_dir), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text("")
    again = plan(run_dir, restarts=1)
    assert again.resume and again.remove == ()
    assert any("no checkpoint" in n for n in again.notes), again.notes
    assert any("torchrun restart 1: resuming" in n for n in again.notes)
    assert again.record == JobRecord(job="job-1", decision="fresh", attempt=1)
    # attempt 1 recorded itself; attempt 2 is still a restart of the same job
    write_job(run_dir, again.record)
    assert plan(run_dir, restarts=2).resume


def test_overwrite_then_restart_resumes_the_first_attempts_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir, steps=8)
    first = plan(run_dir, overwrite=True)
    assert "checkpoints" in first.remove
    # what attempt 0 did: removed the old run, recorded, then saved its own step 2
    for name in first.remove:
        target = run_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    write_job(run_dir, first.record)
    _old_run(run_dir, steps=2)
    restart = plan(run_dir, overwrite=True, restarts=1)  # torchrun repeats the arguments
    assert restart.resume and restart.remove == ()
    # checkpoint.resume=never: starts over, deleting only what this job itself wrote
    never = plan(run_dir, overwrite=True, restarts=1, policy="never")
    assert not never.resume and set(never.remove) <= set(RUN_FILES)


def test_restart_of_a_resumed_job_keeps_resuming_even_with_never(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir)
    first = plan(run_dir, resume=True, policy="never")
    write_job(run_dir, first.record)
    again = plan(run_dir, resume=True, restarts=1, policy="never")
    assert again.resume and again.remove == ()


def test_job_record_round_trip_and_finish(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert read_job(run_dir) is None
    record = JobRecord(job="abc", decision="overwrite", attempt=2)
    write_job(run_dir, record)
    assert read_job(run_dir) == record
    assert [p.name for p in run_dir.iterdir()] == [JOB_FILE]  # no temporary left behind
    finish_job(run_dir)
    assert read_job(run_dir) == JobRecord(job="abc", decision="overwrite", attempt=2, finished=True)
    (run_dir / JOB_FILE).write_text('{"job": "abc", "decision": "delete-all", "attempt": 0}')
    assert read_job(run_dir) is None  # unknown decision: not a record anyone follows
    (run_dir / JOB_FILE).write_text("{trunc")
    assert read_job(run_dir) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "f00d")
    assert job_id() == "f00d"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert job_id() == ""
    # torchrun --master-port: run id "none" for every launch; one node: the agent's pid
    one_node = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    assert job_id(one_node).startswith("none@") and str(os.getppid()) in job_id(one_node)
    assert job_id({**one_node, "WORLD_SIZE": "4"}) == "none"  # multi-node: --rdzv-id needed


# --- real torchrun --------------------------------------------------------------------------


@job("refused_folder")
def _refused_folder_job(folder: Path) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """``torchrun --max-restarts 1`` (``checkpoint.resume=never``) in a folder holding
    another job's run: the result, the folder's files before and after."""
    config = tiny_config(folder)
    run_dir = folder / "run"
    _old_run(run_dir)
    write_job(run_dir, JobRecord(job="an-earlier-job", decision="fresh", attempt=0))
    before = _tree(run_dir)
    proc = torchrun(config, "--set", "checkpoint.resume=never", restarts=1)
    return proc, before, _tree(run_dir)


@pytest.mark.job("refused_folder")
def test_torchrun_restart_never_takes_over_a_refused_folder(background_jobs):
    """``torchrun --max-restarts 1`` in a folder holding another job's run: the old code's
    restart deleted it (``checkpoint.resume=never``) or continued it (``auto``). Both attempts
    must refuse (exit 2 from every worker, so torchrun fails) and leave every byte in place.
    The policy reaches only ``plan_start``, whose answers for both policies on restarts are
    the unit tests above (``test_a_refused_job_keeps_refusing_on_restarts``); one real
    torchrun, with the policy whose old failure lost data, checks the launch around it
    (the job: ``_refused_folder_job``, run in the background)."""
    proc, before, after = background_jobs.result("refused_folder")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "already holds a run" in out and "torchrun restart 1: still refused" in out, out[-3000:]
    assert after == before
