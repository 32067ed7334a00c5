"""Phase 1 of ``run_verify``: the sharded training steps, recorded for the comparison.

The model is the ``parallelize``d copy, fed by the trainer's own ``TrainFeed`` (each rank
loads only its strip), with the trainer's loss, clipping, optimizer and schedule, and every
step is the trainer's own ``train_step`` (so ``verify`` checks the code ``run`` executes,
not a copy of it). Every step runs under ``CommAudit`` (except with ``training.compile``:
Dynamo compiles nothing while a ``TorchDispatchMode`` is active, so an audited step would
check the eager model); its input strip, logits strip,
gradients (before clipping), parameters after the optimizer step and buffers are copied to
the CPU, named as in the user's model (inside a ``DistributedDataParallel`` wrapper). DDP's
gradient all-reduces go through the same c10d ops as every other collective and are
counted with the reductions.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from spconv_train.config import Config
from spconv_train.parallel import CommAudit, local_module, runtime_of
from spconv_train.train.data_feed import TrainFeed
from spconv_train.train.losses import ce_dice_loss, cross_entropy, dice_loss
from spconv_train.train.mesh_coords import to_dtensor
from spconv_train.train.optim import build_loss, build_optimizer, build_scheduler
from spconv_train.train.step import train_step

__all__ = ["StepRecord", "autocast", "low", "sharded_run"]


class _NotAudited(nullcontext):
    """``CommAudit``'s place under ``training.compile`` (see the module docstring)."""

    def __enter__(self) -> _NotAudited:
        return self

    def summary(self) -> dict:
        return {}

    def activation_sized(self, threshold: int, shapes) -> list:
        return []


def autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def low(y: Tensor) -> Tensor:
    """Half-precision logits are scored in float32 (as ``losses.py`` does)."""
    return y.float() if y.dtype in (torch.float16, torch.bfloat16) else y


def _sharded_loss(cfg: Config, device: torch.device, precision: str):
    """The trainer's loss (``build_loss``); in float64 with the class weights in float64
    (``F.cross_entropy`` needs weights of the logits' dtype)."""
    if precision != "fp64":
        return build_loss(cfg, device)
    t, ignore = cfg.training, cfg.data.ignore_index
    w = None if t.class_weights is None else torch.tensor(t.class_weights, device=device).double()
    if t.loss == "ce":
        return lambda y, tgt: cross_entropy(y, tgt, ignore_index=ignore, weight=w)
    if t.loss == "dice":
        return lambda y, tgt: dice_loss(y, tgt, ignore_index=ignore)
    return lambda y, tgt: ce_dice_loss(y, tgt, ignore_index=ignore, weight=w)


def _cpu(t: Tensor) -> Tensor:
    """A CPU copy; a DTensor's full value (FSDP's parameter, gradient and optimizer state
    shards: collective, called in the same order on every rank)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


class StepRecord:
    """What the sharded run leaves for the comparison of one step (CPU copies)."""

    def __init__(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position
        self.loss = 0.0
        self.input = self.logits = None
        self.placements: tuple = ()  # of the logits; () when they are not a DTensor
        self.input_placements: tuple = ()
        self.grads: dict[str, Tensor | None] = {}
        self.params: dict[str, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}
        self.optimizer: dict | None = None  # state after the step (for re-synchronising)


def _keep(t: Tensor) -> Tensor:
    """A CPU copy of a plain tensor now; a DTensor's local shard cloned (no communication),
    for ``_cpu`` to gather later."""
    return t.detach().clone() if isinstance(t, DTensor) else _cpu(t)


def _cpu_tree(obj):
    """A CPU copy of a nested state dict."""
    if isinstance(obj, Tensor):
        return _cpu(obj)
    if isinstance(obj, dict):
        return {k: _cpu_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_tree(v) for v in obj)
    return obj


def sharded_run(
    model, cfg: Config, mesh, device, source, steps: int, precision: str, keep_optimizer: bool
):
    """Phase 1: ``steps`` training steps of the parallelized model, recorded (with the
    optimizer state after each step if ``keep_optimizer``)."""
    feed = TrainFeed(source, cfg, mesh, device)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.training.steps, cfg.optimizer.lr)
    loss_fn = _sharded_loss(cfg, device, precision)
    inner = local_module(model)  # the user's parameter names, without DDP's "module."
    named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
    shapes = {tuple(p.shape) for _, p in named}
    records, comms, shape = [], [], ()
    model.train()
    batches = iter(feed)
    for step in range(steps):
        batch = next(batches)
        rec = StepRecord(feed.epoch, feed.position - 1)
        if precision == "fp64":
            batch.image = to_dtensor(
                batch.image.to_local().double(),
                batch.image.device_mesh,
                batch.image.placements,
                tuple(batch.image.shape),
            )
        halo = runtime_of(model).stats
        halo.reset()

        def record_grads(rec=rec):
            # FSDP's gradient shards are kept as they are and gathered after the audit: the
            # recording's own traffic must not count as the step's
            rec.grads = {n: None if p.grad is None else _keep(p.grad) for n, p in named}

        with _NotAudited() if cfg.training.compile else CommAudit() as audit:
            done = train_step(
                model,
                batch.image,
                batch.target,
                loss_fn,
                optimizer,
                scheduler,
                params=[p for _, p in named],
                grad_clip=cfg.optimizer.grad_clip,
                step=step,
                autocast=autocast(precision, device),
                after_backward=record_grads,
            )
        rec.grads = {n: None if g is None else _cpu(g) for n, g in rec.grads.items()}
        logits = done.logits
        shape = tuple(batch.image.shape)
        rec.loss = done.loss
        rec.input = _cpu(batch.image.to_local())
        rec.input_placements = tuple(batch.image.placements)
        if isinstance(logits, DTensor):
            rec.logits, rec.placements = _cpu(logits.to_local()), tuple(logits.placements)
        else:  # an unsharded output: every rank holds all of it
            rec.logits = _cpu(logits)
        rec.params = {n: _cpu(p) for n, p in inner.named_parameters()}
        rec.buffers = {n: _cpu(b) for n, b in inner.named_buffers()}
        if keep_optimizer and step + 1 < steps:
            rec.optimizer = _cpu_tree(optimizer.state_dict())
        records.append(rec)
        # A quarter of one image's input strip: far above any statistics reduction.
        threshold = max(1, batch.image.to_local()[0].numel() // 4)
        flagged = [
            f"step {step + 1} rank {dist.get_rank()}: {r.op} of shape {r.shape} ({r.numel:,} el.)"
            for r in audit.activation_sized(threshold, shapes)
        ]
        comms.append((audit.summary(), halo.halo_seconds, flagged))
        del logits, done, batch
    return records, comms, shape
