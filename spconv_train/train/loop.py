"""``spconv-train run``: set-up, the training loop, validation and checkpoints.

``train(cfg, resume=..., remove=...)`` is what the CLI calls once the config is valid and
the run directory decision is made (``spconv_train.logging.run_folder.plan_start``).
Every rank runs the same code; only rank 0 writes logs. After ``backward()`` every rank
holds the single-device gradient of the global batch (the parallelized model all-reduces
parameter gradients over the mesh), so optimizer, clipping and schedule are plain
single-device code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh

from spconv_train.checkpoint import CheckpointError, CheckpointManager
from spconv_train.config import (
    Config,
    ConfigError,
    check_resume_steps,
    config_to_dict,
    describe_grid,
    dump_config,
    grid_mesh_dims,
    resolve_grid,
)
from spconv_train.data import SegmentationSource
from spconv_train.distributed import (
    DistInfo,
    build_mesh,
    default_timeout_s,
    env_rank,
    env_world_size,
    gather_all,
    init_distributed,
    peak_memory_mb,
    seed_everything,
    spatial_mesh,
)
from spconv_train.distributed.launch_store import mark_recorded
from spconv_train.logging import RunLogger
from spconv_train.logging.overwrite import remove_run_files
from spconv_train.logging.run_folder import JobRecord, write_job
from spconv_train.models import build_model
from spconv_train.parallel import local_module, runtime_of
from spconv_train.train.bad_samples import (
    note_training_skips,
    report_skipped,
    skipped_summary,
    upfront_skips,
)
from spconv_train.train.console import summary_lines
from spconv_train.train.data_feed import TrainFeed, build_sources
from spconv_train.train.determinism import seed_for_step
from spconv_train.train.mesh_coords import MeshCoords
from spconv_train.train.model_setup import compile_model, prepare_model
from spconv_train.train.nonfinite import explain_non_finite
from spconv_train.train.optim import (
    apply_hyperparameters,
    build_loss,
    build_optimizer,
    build_scheduler,
)
from spconv_train.train.preemption import Preempted, StopRequests
from spconv_train.train.step import NonFiniteStep, TrainingStopped, train_step
from spconv_train.train.val_check import check_val_sizes
from spconv_train.train.validation import log_val, validate
from spconv_train.train.watchdog import Watchdog, process_group_timeout

__all__ = ["TrainingStopped", "build_model", "train", "validate"]

# What the watchdog names when a rank hangs in a phase of ``train_step``.
_STEP_PHASES = {
    "loss": "loss (all-reduce over the mesh)",
    "backward": "backward pass (halo exchanges, gradient all-reduce)",
}


def _prepare_run_dir(
    cfg: Config, remove: Sequence[str], info: DistInfo, job: JobRecord | None = None
) -> list[str]:
    """Rank 0 deletes ``remove`` (an overwritten run's files: all or none,
    ``overwrite.remove_run_files``), records the job's start decision and writes the
    resolved config; the other ranks wait. Returns the lines saying what was removed."""
    run_dir, removed = Path(cfg.run_dir), []
    if info.is_main:
        removed = remove_run_files(run_dir, remove)
        if job is not None:
            write_job(run_dir, job)
            mark_recorded(job.job)  # later attempts of this launch, on every node, follow it
        dump_config(cfg, run_dir / "config.yaml")
    dist.barrier()
    return removed


@dataclass
class _Run:
    """Everything the loop and validation share."""

    cfg: Config
    info: DistInfo
    mesh: DeviceMesh
    model: nn.Module
    val_source: SegmentationSource
    class_names: list[str]
    logger: RunLogger
    watchdog: Watchdog
    stops: StopRequests
    skipped: list = field(default_factory=list)  # SkipRecord of every skipped file
    loss_window: tuple[float, int] = (0.0, 0)  # (loss sum, steps) a resumed run continues

    def __post_init__(self) -> None:
        self.sp_mesh = spatial_mesh(self.mesh)  # validation images live on the spatial group
        self.coords = MeshCoords.of(self.mesh)
        self.loss_fn = build_loss(self.cfg, self.info.device)

    def autocast(self) -> torch.autocast:
        """bf16 autocast when ``training.precision`` asks for it (a no-op context otherwise)."""
        bf16 = self.cfg.training.precision == "bf16"
        return torch.autocast(self.info.device.type, dtype=torch.bfloat16, enabled=bf16)


def _loss_window(extra: dict) -> tuple[float, int]:
    """The saved ``[loss sum, steps]`` of the open logging window (none in older
    checkpoints, or not a pair of numbers: an empty window)."""
    w = extra.get("loss_window")
    ok = isinstance(w, list) and len(w) == 2 and all(isinstance(v, (int, float)) for v in w)
    return (float(w[0]), int(w[1])) if ok and w[1] >= 0 else (0.0, 0)


def _rank_stats(run: _Run) -> list[tuple[float, float]]:
    """(peak memory MiB, halo seconds since the last call) of every rank."""
    halo = runtime_of(run.model).stats
    mine = (peak_memory_mb(run.info.device), halo.halo_seconds)
    halo.reset()
    return gather_all(mine)


def _resume(ckpt: CheckpointManager, folder: Path, model, optimizer, scheduler) -> tuple:
    """``ckpt.load`` with a one-line ``ConfigError`` when the checkpoint does not fit (the
    model or optimizer settings changed since it was saved) instead of DCP's per-rank dump."""
    try:
        return ckpt.load(folder, model, optimizer, scheduler=scheduler)
    except CheckpointError:  # says itself what is wrong and what to do
        raise
    except (Exception, CheckpointException) as exc:
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = next(iter(exc.failures.values()))[0]
        raise ConfigError(
            str(folder),
            f"cannot resume from this checkpoint: {type(exc).__name__}: {exc}. Resume with the "
            "model and optimizer settings it was saved with, or start over with --overwrite",
        ) from exc


def train(
    cfg: Config,
    *,
    resume: bool = False,
    remove: Sequence[str] = (),
    notes: Sequence[str] = (),
    job: JobRecord | None = None,
) -> dict:
    """Run ``cfg`` on every rank (collective); returns the final validation scores.

    ``resume``: continue from the latest checkpoint in ``cfg.run_dir`` if there is one.
    ``remove``: names inside ``run_dir`` to delete first (``--overwrite``), after every
    set-up check has passed. ``notes``: lines rank 0 prints at the start. ``job``: the
    start decision rank 0 records in ``run_dir`` (``spconv_train.logging.run_folder``).

    Raises ``ConfigError``/``DataError``/``SpatialShardingError`` for set-up problems,
    ``TrainingStopped`` for a non-finite loss or gradient (no checkpoint is written then),
    ``Preempted`` after SIGTERM/SIGUSR1 (on any rank) once the step's checkpoint is written.
    A rank stuck longer than ``parallel.timeout_s`` in one phase ends its process with the
    watchdog's message (``spconv_train.train.watchdog``).
    """
    timeout_s = cfg.parallel.timeout_s or default_timeout_s()
    multi = env_world_size() > 1  # one process has no peer to wait for
    with Watchdog(timeout_s, env_rank(), enabled=multi) as watchdog, StopRequests() as stops:
        return _train(cfg, resume, remove, notes, job, watchdog, stops)


def _train(cfg, resume, remove, notes, job, watchdog: Watchdog, stops: StopRequests) -> dict:
    seed_everything(cfg.training.seed)  # same initial weights on every rank
    model = build_model(cfg)
    train_source, val_source, class_names = build_sources(cfg)
    info = init_distributed(
        cfg.parallel.backend,
        process_group_timeout(watchdog.timeout_s),
        cpu_affinity=cfg.parallel.cpu_affinity,
    )
    watchdog.beat("set-up: mesh, run folder and resume (barriers, checkpoint-load collectives)")
    dp, sp = resolve_grid(cfg, info.world_size)  # parallel.sp: 0 -> the chosen grid
    mesh = build_mesh(dp, sp, info.device.type, grid_mesh_dims(cfg))
    run_dir = Path(cfg.run_dir)
    # parallelize, activation checkpointing, FSDP (then compile): as verify builds it
    model = prepare_model(model.to(info.device), mesh, cfg, cfg.training.precision)
    check_val_sizes(
        local_module(model), val_source, cfg, MeshCoords.of(mesh), spatial_mesh(mesh), info.device
    )
    if resume:  # before config.yaml is rewritten: a refused resume changes nothing
        check_resume_steps(cfg.training.steps, CheckpointManager(run_dir).newest_step())
    notes = [*notes, *_prepare_run_dir(cfg, remove, info, job)]  # after every check
    compile_model(model, cfg)
    optimizer = build_optimizer(model, cfg.optimizer)
    steps = cfg.training.steps
    scheduler = build_scheduler(optimizer, cfg.schedule, steps, cfg.optimizer.lr)
    feed = TrainFeed(train_source, cfg, mesh, info.device)
    ckpt = CheckpointManager(
        run_dir, keep_last=cfg.checkpoint.keep_last, keep_best=cfg.checkpoint.keep_best
    )
    # newest_good: the newest checkpoint whose files match their checksums
    start, latest = 0, ckpt.newest_good() if resume else None
    if latest is not None:
        start, extra = _resume(ckpt, latest, model, optimizer, scheduler)
        apply_hyperparameters(optimizer, scheduler, cfg.optimizer)  # changed on resume
        feed.load_state_dict(extra.get("data", feed.state_dict()))  # data position
    lg = cfg.logging
    logger = RunLogger(
        run_dir,
        enabled=info.is_main,
        tensorboard=lg.tensorboard,
        progress=lg.progress,
        total_steps=steps,
        resume_step=start if resume else None,  # drop log lines after the restart point
        log_every=cfg.training.log_every,
    )
    run = _Run(cfg, info, mesh, model, val_source, class_names, logger, watchdog, stops)
    run.skipped = upfront_skips(train_source, val_source)
    run.loss_window = _loss_window(extra) if latest is not None else (0.0, 0)
    report_skipped(logger, run.skipped, write=latest is None)  # resumed: already written
    try:
        return _loop(run, feed, optimizer, scheduler, ckpt, start, latest, notes)
    finally:
        logger.close()


def _loop(run: _Run, feed, optimizer, scheduler, ckpt, start, latest, notes) -> dict:
    cfg, info, model, logger, wd = run.cfg, run.info, run.model, run.logger, run.watchdog
    t, steps = cfg.training, cfg.training.steps
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    where = f"resumed from {latest}" if latest is not None else "fresh start"
    c = run.coords
    logger.info(
        f"spconv-train: {info.world_size} rank(s), mesh dp={c.dp} x sp={c.sp}"
        f"{describe_grid(cfg)}, "
        f"{info.backend} on {info.device.type}; {cfg.model.name} ({n_params:,} "
        f"params); {where}; run dir {cfg.run_dir}"
    )
    for line in notes:
        logger.info(f"  {line}")
    model.train()
    step, scores, last_scores = start, None, {}
    # The loss window is restored on resume (the uninterrupted run's mean); timing restarts.
    (loss_sum, loss_n), timed, pixels, tick = run.loss_window, 0, 0, time.perf_counter()
    runtime_of(model).stats.reset()
    logger.progress_start(steps, initial=start)
    batches = iter(feed)
    run.stops.install()  # SIGTERM/SIGUSR1 now end the run after a step, with a checkpoint
    while step < steps:
        # Each phase names its collectives: the watchdog's message says where a rank hung.
        wd.beat(f"step {step + 1}: data and forward pass (halo exchanges, norm all-reduces)")
        seed_for_step(t.seed, step)  # RNG by step: the same after a resume on any layout
        batch = next(batches)
        run.skipped += note_training_skips(logger, feed, step + 1)
        try:
            done = train_step(
                model,
                batch.image,
                batch.target,
                run.loss_fn,
                optimizer,
                scheduler,
                params=params,
                grad_clip=cfg.optimizer.grad_clip,
                step=step,
                autocast=run.autocast(),
                on_phase=lambda phase, n=step + 1: wd.beat(f"step {n}: {_STEP_PHASES[phase]}"),
            )
        except NonFiniteStep as exc:  # name the step's files; data or divergence?
            why = explain_non_finite(exc, batch.image, batch.samples, feed.source, cfg)
            raise TrainingStopped(why) from None
        value, grad_norm, lr = done.loss, done.grad_norm, done.lr
        del done
        step += 1
        wd.beat(f"step {step}: stop-signal all-reduce")
        # Every rank stops after the same step, whichever rank(s) got the signal. At the
        # last step the run is complete anyway: finish it normally.
        stop = run.stops.agree(info.device) if step < steps else None
        loss_sum, loss_n, timed = loss_sum + value, loss_n + 1, timed + 1
        pixels += batch.pixels
        # The window mean so far: at a log step it equals the "loss" in metrics.jsonl.
        logger.progress_update(step, loss=loss_sum / loss_n, lr=lr)
        if step % t.log_every == 0 or step == steps:
            wd.beat(f"step {step}: logging (all_gather of per-rank statistics)")
            elapsed = time.perf_counter() - tick
            stats = _rank_stats(run)
            logger.scalars(
                step,
                {
                    "loss": loss_sum / loss_n,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "throughput_mpx_s": pixels / elapsed / 1e6,
                    "step_time_s": elapsed / timed,
                    "halo_s_per_step": max(h for _, h in stats) / timed,
                    "epoch": feed.epoch,
                },
            )
            memory = {f"peak_mb_rank{r}": m for r, (m, _) in enumerate(stats[:16])}
            logger.scalars(step, {"peak_mb_max": max(m for m, _ in stats), **memory}, "memory")
            loss_sum, loss_n, timed, pixels, tick = 0.0, 0, 0, 0, time.perf_counter()
        # Validation and checkpoints are not training: keep their time and halo traffic out
        # of the throughput and halo figures of the current logging interval.
        paused, halo = time.perf_counter(), runtime_of(model).stats.snapshot()
        scores = None
        # A preempted job has seconds left: they are for the checkpoint, not validation.
        if (step % t.val_every == 0 or step == steps) and not stop:
            scores = last_scores = validate(run, step)
            log_val(run, step, scores)
        if step % cfg.checkpoint.every == 0 or step == steps or stop:
            wd.beat(f"step {step}: checkpoint save (distributed-checkpoint collectives)")
            shared = {"data": feed.state_dict(), "loss_window": [loss_sum, loss_n]}  # any layout
            metric = None if scores is None else scores["miou"]
            metric = None if metric is None or math.isnan(metric) else metric
            ckpt.save(step, model, optimizer, scheduler=scheduler, shared=shared, metric=metric)
        if stop:
            logger.progress_stop()
            raise Preempted(stop, step, steps, str(ckpt.latest()))
        tick += time.perf_counter() - paused
        runtime_of(model).stats.restore(halo)
    logger.progress_stop()
    wd.beat(f"step {step}: export of model.pt and final report (barrier)")
    return _finish(run, ckpt, last_scores, step)


def _finish(run: _Run, ckpt: CheckpointManager, scores: dict, step: int) -> dict:
    cfg, logger = run.cfg, run.logger
    export = Path(cfg.run_dir) / "model.pt"
    CheckpointManager.export(run.model, export, config=config_to_dict(cfg))
    if not scores:  # resumed at the final step: nothing ran, validate once for the report
        scores = validate(run, step)
    final = {k: scores[k] for k in ("loss", "pixel_accuracy", "miou", "mean_dice")}
    logger.hparams(config_to_dict(cfg), final)
    if scores.get("iou"):
        logger.per_class_table(
            run.class_names, scores["iou"], scores["dice"], scores["class_accuracy"]
        )
    logger.summary(
        "spconv-train run",
        [
            ("steps", str(step)),
            ("val loss", final["loss"]),
            ("pixel accuracy", final["pixel_accuracy"]),
            ("mIoU (macro over classes)", final["miou"]),
            ("mean Dice (macro over classes)", final["mean_dice"]),
            ("skipped samples", skipped_summary(run.skipped)),
        ],
    )
    for line in summary_lines(ckpt, cfg.run_dir, export):  # whole paths, outside the table
        logger.info(line)
    logger.flush()
    return scores
