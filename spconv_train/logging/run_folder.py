"""The run folder: what a run leaves in it, and how a job starts there (no torch).

The decision *fresh / resume / overwrite* is made once per job and is the same on every
attempt of it. Every rank makes it (:func:`plan_start`) before any process group exists;
once the set-up checks have passed, rank 0 records it in ``run_dir/job.json`` (written
atomically) together with the job's identity, torchrun's ``TORCHELASTIC_RUN_ID``. When
torchrun restarts the workers, the restarted attempt finds its own job's record and does
the same thing again:

- a job that started fresh or with ``--overwrite`` resumes the checkpoints its earlier
  attempts wrote (``checkpoint.resume: auto``; from step 0 if there is none yet) or starts
  over deleting only its own files (``checkpoint.resume: never``);
- a job that resumed keeps resuming;
- a job whose first attempt was refused (the folder holds another run) never recorded
  anything, so every restart applies the first-attempt rules again and refuses again,
  leaving the folder untouched. A new job in a folder whose previous job crashed is
  refused too (pass ``--resume`` or ``--overwrite``).

A record counts as the current job's only when it has the same non-empty run id, is not
marked finished, and was written by an earlier attempt of this launch. Whether it was is
asked of torchrun's store (``spconv_train.distributed.launch_store``), which lives as long as the
launch, across restarts, and which rank 0 marks once the record is written: torchrun counts
restarts per node, and on several nodes a healthy node's workers are restarted for the new
rendezvous round with ``TORCHELASTIC_RESTART_COUNT`` still 0, while the failed node's count
went up. Only without such a store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) the restart
count decides: a restart (count > 0) newer than the record. A single-node ``torchrun`` draws a
fresh random run id per launch (or, with ``--master-port``, is told apart by its process
id); multi-node jobs should give each job its own ``--rdzv-id`` (e.g. the scheduler's job
id).

``--overwrite`` deletes all of the previous run's files or none
(``spconv_train.logging.overwrite``): every entry is checked before anything is removed,
links are removed without following them.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from spconv_train.config import (
    Config,
    ConfigError,
    changed_settings,
    check_resume_changes,
    config_to_dict,
    load_config,
)
from spconv_train.logging.overwrite import check_removable

__all__ = [
    "JOB_FILE",
    "RUN_FILES",
    "JobRecord",
    "StartPlan",
    "finish_job",
    "job_id",
    "plan_start",
    "read_job",
    "write_job",
]

#: The job record (see the module docstring).
JOB_FILE = "job.json"

#: What a run leaves in its directory (the only things ``--overwrite`` deletes).
RUN_FILES = ("config.yaml", "checkpoints", "tensorboard", "metrics.jsonl", "model.pt", JOB_FILE)

Decision = Literal["fresh", "resume", "overwrite"]


@dataclass(frozen=True)
class JobRecord:
    """The decision of one job in its run folder.

    Attributes:
        job: torchrun's run id (``""`` outside torchrun: never matches a restart).
        decision: what the job's first attempt did: ``fresh``, ``resume`` or ``overwrite``.
        attempt: the latest attempt (torchrun restart count) that started with this record.
        finished: set when the job's training completed (a later launch is a new job).
    """

    job: str
    decision: Decision
    attempt: int = 0
    finished: bool = False


@dataclass(frozen=True)
class StartPlan:
    """How ``run`` starts: ``resume`` from the latest checkpoint (if any); ``remove`` the
    previous run's files first (``--overwrite``); ``notes`` to print; ``record`` for rank 0
    to write into the run folder once the set-up checks passed (:func:`write_job`)."""

    resume: bool = False
    remove: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    record: JobRecord | None = None


def job_id(env: Mapping[str, str] | None = None) -> str:
    """This job's identity: torchrun's run id (``""`` when not launched by torchrun).

    With ``--master-port`` torchrun's run id is the constant ``"none"``; on a single node it
    is then qualified with the torchrun process (every worker's parent, alive for the whole
    job), so two launches never share an identity. Multi-node jobs need ``--rdzv-id``.
    """
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id == "none" and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"):
        return f"none@{socket.gethostname()}:{os.getppid()}"
    return run_id


def read_job(run_dir: str | Path) -> JobRecord | None:
    """The job record in ``run_dir``, or None if missing or unreadable (then no restart can
    take it for its own: the folder is refused, never deleted)."""
    try:
        data = json.loads((Path(run_dir) / JOB_FILE).read_text())
        record = JobRecord(
            job=str(data["job"]),
            decision=data["decision"],
            attempt=int(data["attempt"]),
            finished=bool(data.get("finished", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if record.decision in ("fresh", "resume", "overwrite") else None


def write_job(run_dir: str | Path, record: JobRecord) -> None:
    """Write ``record`` to ``run_dir/job.json`` atomically (rank 0 only)."""
    path = Path(run_dir) / JOB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{JOB_FILE}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(asdict(record), indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def finish_job(run_dir: str | Path) -> None:
    """Mark the job in ``run_dir`` finished (rank 0, after training completed)."""
    record = read_job(run_dir)
    if record is not None and not record.finished:
        write_job(run_dir, replace(record, finished=True))


def _own_record(run_dir: Path, job: str, restarts: int, recorded: bool | None) -> JobRecord | None:
    """The record of the current job if this attempt is a restart of it, else None.

    ``recorded``: whether an earlier attempt of this launch recorded its decision (torchrun's
    store says so on every node, whatever its restart count); None when there is no such
    store, then only a restart newer than the record counts."""
    record = read_job(run_dir)
    if not job or record is None or record.job != job or record.finished:
        return None
    if recorded is None:
        recorded = restarts > 0 and record.attempt < restarts
    return record if recorded else None


def _has_checkpoint(run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir())


def _resume_notes(cfg: Config, run_dir: Path) -> list[str]:
    """Notes on resuming in ``run_dir``; ``ConfigError`` for a setting that cannot change on
    resume from a checkpoint (``RESUME_POLICY``). Without a checkpoint everything may change."""
    has_ckpt = _has_checkpoint(run_dir)
    notes = [] if has_ckpt else [f"no checkpoint in {run_dir} yet; starting from step 0"]
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return notes
    try:
        old = config_to_dict(load_config(saved, check_paths=False))
    except ConfigError:  # written by another version: nothing to compare against
        return [*notes, f"{saved} is unreadable; settings not compared"]
    new = config_to_dict(cfg)
    if has_ckpt:
        return check_resume_changes(old, new)
    changes = changed_settings(old, new)
    return notes + [f"{k}: {a!r} -> {b!r} (changed since the saved config)" for k, a, b in changes]


def plan_start(
    cfg: Config,
    *,
    resume: bool,
    overwrite: bool,
    restarts: int,
    job: str = "",
    recorded: bool | None = None,
) -> StartPlan:
    """Decide how ``run`` starts in ``cfg.run_dir`` (reads only; before any process group).

    First attempt of a job (or a restart that finds no record of its job): a folder holding
    a run (any of ``RUN_FILES``) is refused unless ``resume`` or ``overwrite``; ``resume``
    without a checkpoint starts fresh (with a note), so a job script may always pass
    ``--resume``. A restart of a recorded job follows that job's decision (module docstring;
    ``recorded``: ``launch_store.launch_recorded``). Resuming from a checkpoint refuses
    settings that cannot change (``RESUME_POLICY``); a plan that deletes files checks first
    that every one can be deleted (``overwrite.check_removable``). Raises ``ConfigError``
    (exit 2) for a refusal.
    """
    run_dir = Path(cfg.run_dir)
    if resume and overwrite:
        raise ConfigError("--resume", "cannot be combined with --overwrite; pick one")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("run_dir", f"{run_dir} exists and is not a directory")
    # lexists: a dangling link is found too (and removed, never followed)
    found = tuple(name for name in RUN_FILES if os.path.lexists(run_dir / name))
    own = _own_record(run_dir, job, restarts, recorded)
    if own is not None:
        plan = _restart_plan(cfg, own, resume=resume, found=found, restarts=restarts)
        check_removable(run_dir, plan.remove)
        return plan
    if found and not (resume or overwrite):
        again = f" (torchrun restart {restarts}: still refused)" if restarts > 0 else ""
        raise ConfigError(
            "run_dir",
            f"{run_dir} already holds a run ({', '.join(found)}){again}; pass --resume to "
            "continue it, --overwrite to start over, or choose another folder with "
            "--set run_dir=...",
        )
    decision: Decision = "overwrite" if overwrite else "resume" if resume else "fresh"
    notes = _resume_notes(cfg, run_dir) if resume else []
    record = JobRecord(job=job, decision=decision, attempt=max(restarts, 0))
    remove = found if overwrite else ()
    check_removable(run_dir, remove)  # before anything is deleted: all or nothing
    return StartPlan(resume=resume, remove=remove, notes=notes, record=record)


def _restart_plan(
    cfg: Config, own: JobRecord, *, resume: bool, found: tuple[str, ...], restarts: int
) -> StartPlan:
    """A restart of the job that recorded ``own``: resume its checkpoints, or (fresh or
    overwritten job, ``checkpoint.resume: never``) start over deleting its own files."""
    record = replace(own, attempt=max(own.attempt, restarts))
    # A healthy node's workers restarted for a new rendezvous round keep the count 0.
    head = f"torchrun restart {restarts}" if restarts > 0 else "torchrun restart (new round)"
    why = f"this job started as {own.decision}"
    if resume or own.decision == "resume" or cfg.checkpoint.resume == "auto":
        notes = [f"{head}: resuming ({why})", *_resume_notes(cfg, Path(cfg.run_dir))]
        return StartPlan(resume=True, notes=notes, record=record)
    # Only this job wrote here (its first attempt started fresh or emptied the folder).
    notes = [f"{head}: starting over ({why}; checkpoint.resume=never)"]
    return StartPlan(resume=False, remove=found, notes=notes, record=record)
