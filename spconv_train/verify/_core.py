"""``run_verify``: K training steps sharded and on one device, compared tensor by tensor.

Both runs start from the same weights (``training.seed``) and see the same batches:

1. **Sharded run** (every rank): the model is ``parallelize``d over the configured
   ``(dp, sp)`` mesh (and compiled in place with ``training.compile``, as ``run`` does)
   and fed by the trainer's own ``TrainFeed`` (each rank loads only its strip), with the
   sharded loss of ``training.loss``, gradient clipping, optimizer and schedule exactly as
   ``spconv-train run`` does. Every step runs under ``CommAudit``; its input strip, logits
   strip, gradients (before clipping), parameters after the optimizer step and buffers are
   kept (on the CPU) for the comparison.
2. **Reference run** (a plain copy of the model, plain ``F.cross_entropy`` / Dice on full
   tensors): every rank (``reference="all"``) or only rank 0 (``"rank0"``, which then sends
   each rank the reference values it needs) loads the FULL images of the same samples with
   the same augmentation parameters and trains the same steps. After each step every rank
   compares its own part, and one all-reduce per step gives the maxima over all ranks.

Both run in float64 by default (``dtype="float64"``): then any difference above rounding
(<= ~1e-9) is a bug, while in fp32 rounding can flip a ReLU or max-pool tie and change a
gradient outright (see ``_compare.py``); ``dtype="config"`` uses ``training.precision``.
The sharded run goes first so its peak memory is measured without the reference
(``_sharded.py``), then the reference runs and is compared step by step (``_reference.py``).
Dropout: per-strip dropout masks cannot equal one device's mask, so every dropout layer's
``p`` is set to 0 on both sides (the report says so), and so is the drop probability of
timm's stochastic depth (``DropPath``), whose masks the two runs would draw apart.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spconv_train.config import Config, describe_grid, grid_mesh_dims, resolve_grid
from spconv_train.distributed import build_mesh, gather_all, peak_memory_mb, seed_everything
from spconv_train.models import build_model
from spconv_train.train.data_feed import build_sources
from spconv_train.train.model_setup import compile_model, prepare_model

from ._compare import SPREAD_FACTOR, resolve_tolerances
from ._reference import reference_run
from ._report import VerifyReport
from ._sharded import sharded_run

__all__ = ["run_verify"]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduction_note(model: nn.Module, cfg: Config) -> str:
    """How the sharded run's parameter gradients were summed over the ranks, and whether
    the audited 'reductions' column counts them."""
    if isinstance(model, DistributedDataParallel):
        world = dist.get_world_size(model.process_group)
        return (
            f"parameter gradients are averaged over all {world} ranks by "
            "DistributedDataParallel (parallel.grad_reduce: ddp): one all-reduce per "
            "bucket of every parameter, in the 'reductions' column"
        )
    if cfg.parallel.fsdp:
        return "parameter gradients are reduce-scattered by FSDP2 (parallel.fsdp)"
    if dist.get_world_size() == 1:
        return "one rank: no parameter gradient is reduced"
    return (
        "parameter gradients are summed by the built-in bucketed reducer "
        "(parallel.grad_reduce: builtin); its all-reduces are in the 'reductions' column"
    )


def _disable_dropout(model: nn.Module) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p, n = 0.0, n + 1
        elif type(m).__name__ == "DropPath" and getattr(m, "drop_prob", 0) > 0:
            # timm's stochastic depth (MiT, ConvNeXt): both runs draw their own masks
            m.drop_prob, n = 0.0, n + 1
    return n


def _user_tolerances(tolerances: dict | None) -> bool:
    """Whether any tolerance was set (``None`` values are defaults)."""
    return any(v is not None for v in (tolerances or {}).values())


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _comm_table(per_rank: list[list[tuple]]) -> tuple[list[dict], list[str]]:
    """Per step: each rank's collective summary, the max over ranks, and the flags."""
    steps, flagged = [], []
    for k in range(len(per_rank[0])):
        ranks = [r[k][0] for r in per_rank]
        top: dict = {}
        for summary in ranks:
            for kind, v in summary.items():
                t = top.setdefault(kind, {"count": 0, "elements": 0})
                t["count"], t["elements"] = (
                    max(t["count"], v["count"]),
                    max(t["elements"], v["elements"]),
                )
        halo = max(r[k][1] for r in per_rank)
        steps.append({"step": k + 1, "max_per_rank": top, "per_rank": ranks, "halo_s": halo})
        for r in per_rank:
            flagged += r[k][2]
    return steps, flagged


def run_verify(
    config: Config,
    *,
    steps: int = 3,
    tolerances: dict | None = None,
    json_path: str | Path | None = None,
    console: Console | None = None,
    reference: str = "all",
    dtype: str = "float64",
    resync: bool = True,
) -> VerifyReport:
    """Train ``steps`` steps sharded over the configured mesh and on one device from the same
    weights and batches, and compare loss, logits, every gradient, every parameter after the
    optimizer step and every buffer (BatchNorm running statistics) at each step.

    Collective: every rank of an initialised process group calls it (gloo on CPU, nccl
    with one GPU per rank). ``dtype``: ``"float64"`` (both runs in float64: an exact
    check) or ``"config"`` (``training.precision``). ``tolerances``: see
    ``resolve_tolerances`` (defaults depend on the precision). ``reference``: ``"all"``
    runs the reference on every rank, ``"rank0"`` only on rank 0 (less host memory when
    ranks share a machine). ``resync``: start every step of the reference from the sharded
    run's state after the previous step (False: two independent runs). Rank 0 prints
    the tables to ``console`` and writes ``json_path``. Returns the same report on every
    rank. Raises ``ConfigError``/``DataError``/``SpatialShardingError`` for set-up
    problems (on every rank together).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if reference not in ("all", "rank0"):
        raise ValueError(f"reference must be 'all' or 'rank0', got {reference!r}")
    if dtype not in ("float64", "config"):
        raise ValueError(f"dtype must be 'float64' or 'config', got {dtype!r}")
    cfg, device = config, _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, sp = resolve_grid(cfg, world)  # parallel.sp: 0 -> the chosen grid
    precision = "fp64" if dtype == "float64" else cfg.training.precision
    tols = resolve_tolerances(precision, tolerances)
    # In the training precision the one-device rounding noise is measured (a float64 copy
    # of the reference), unless the user set the tolerances: then those alone decide.
    noise = precision != "fp64" and not _user_tolerances(tolerances)
    mesh = build_mesh(dp, sp, device.type, grid_mesh_dims(cfg))
    seed_everything(cfg.training.seed)  # the same initial weights on every rank
    model = build_model(cfg)
    if precision == "fp64":
        model = model.double()
    n_dropout = _disable_dropout(model)
    source, _, _ = build_sources(cfg)
    runs_ref = reference == "all" or rank == 0
    ref = copy.deepcopy(model) if runs_ref else None  # stays on the CPU during phase 1
    # parallelize, activation checkpointing, FSDP and compile exactly as ``run`` builds it
    sharded = prepare_model(model.to(device), mesh, cfg, precision)
    compile_model(sharded, cfg)
    _reset_peak(device)
    records, comms, shape = sharded_run(
        sharded, cfg, mesh, device, source, steps, precision, keep_optimizer=resync and runs_ref
    )
    sharded_mb = peak_memory_mb(device)
    reduction = _reduction_note(sharded, cfg)
    del sharded, model
    _reset_peak(device)
    ref = ref.to(device) if ref is not None else None
    checks = reference_run(
        ref, cfg, mesh, device, source, records, tols, reference, precision, resync, noise
    )
    ref_mb = peak_memory_mb(device) if runs_ref else None
    measure = "CUDA max allocated" if device.type == "cuda" else "CPU peak RSS"
    memory = gather_all(
        {"rank": rank, "sharded_mb": sharded_mb, "reference_mb": ref_mb, "measure": measure}
    )
    comm_steps, flagged = _comm_table(gather_all(comms))
    notes = [
        f"dropout / stochastic depth set to 0 in {n_dropout} module(s) on both sides: "
        "per-strip dropout masks cannot equal one device's mask"
        if n_dropout
        else "the model has no active dropout",
        "gradients are compared before clipping; parameters after the optimizer step",
        "each step starts both runs from the same state (the reference takes the sharded "
        "run's parameters, buffers and optimizer state after the previous step): training "
        "is chaotic, and rounding differences would otherwise grow from step to step"
        if resync and steps > 1
        else "two independent runs: rounding differences may grow from step to step",
        f"computed in float64 on both sides (exact check; training uses "
        f"{cfg.training.precision}: --dtype config checks that precision)"
        if precision == "fp64"
        else f"computed in the training precision ({precision}); --dtype float64 gives an "
        "exact check free of rounding ties"
        + (
            f". A tensor also passes when its relative error is within {SPREAD_FACTOR:g}x "
            f"the one-device {precision} run's own relative distance from the same step in "
            "float64, worst over the tensors of its kind (the rounding noise of that "
            "precision; 'fp64_spread' in --json; off when --rtol or --atol is given)"
            if noise
            else ""
        ),
        f"the sharded run is compiled (training.compile, backend "
        f"{cfg.training.compile_backend}); the reference runs eagerly; communication is "
        "not audited (Dynamo compiles nothing while the audit's dispatch mode is active)"
        if cfg.training.compile
        else "the sharded run is not compiled (training.compile: false)",
        reduction,
        "reference run on every rank"
        if reference == "all"
        else "reference run on rank 0 only; it sends each rank the blocks to compare",
    ]
    if device.type == "cpu":
        notes.append(
            "CPU peak RSS is the process high-water mark: the reference runs second, so its "
            "column is the larger of both runs"
        )
    report = VerifyReport(
        checks=checks,
        steps=steps,
        world_size=world,
        dp=dp,
        sp=sp,
        grid=describe_grid(cfg),
        model=cfg.model.name,
        precision=precision,
        batch_shape=shape,
        reference=reference,
        tolerances=tols,
        notes=notes,
        memory=memory,
        comms=comm_steps,
        flagged=flagged,
    )
    if rank == 0:
        report.render(console or Console())
        if json_path is not None:
            report.write_json(json_path)
    return report
