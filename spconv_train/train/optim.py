"""The pieces of a training step around the model: loss, optimizer, learning-rate schedule,
gradient clipping and activation checkpointing, built from the config sections.

After ``backward()`` on a parallelized model every rank holds the full single-device
gradient of every (replicated) parameter, so these plain-tensor utilities give the same
result on every rank without communication.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from spconv_train.config import Config, OptimizerConfig, ScheduleConfig
from spconv_train.parallel import current_runtime
from spconv_train.parallel.extend import SpatialMode
from spconv_train.train.losses import ce_dice_loss, cross_entropy, dice_loss
from spconv_train.train.rare_class_losses import focal_loss, tversky_loss

__all__ = [
    "apply_hyperparameters",
    "build_loss",
    "build_optimizer",
    "build_scheduler",
    "checkpoint_blocks",
    "clip_gradients",
    "enable_activation_checkpointing",
    "lr_factor",
]


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weight decay on conv/linear weights, none on biases and norm scales.

    Decaying 1-D parameters (biases, BatchNorm/GroupNorm affine) only pulls them towards 0
    without regularising anything useful; this is the usual practice (timm, torchvision).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_loss(cfg: Config, device: torch.device):
    """``loss(logits, target_strip)`` for ``training.loss`` (ce, dice, ce+dice, focal or
    tversky), with ``training.class_weights`` (ce, ce+dice, focal), the focal / Tversky
    parameters and ``data.ignore_index``; a global value on every rank."""
    t, ignore = cfg.training, cfg.data.ignore_index
    weight = None if t.class_weights is None else torch.tensor(t.class_weights, device=device)
    if t.loss == "ce":
        return lambda y, tgt: cross_entropy(y, tgt, ignore_index=ignore, weight=weight)
    if t.loss == "dice":
        return lambda y, tgt: dice_loss(y, tgt, ignore_index=ignore)
    if t.loss == "focal":
        return lambda y, tgt: focal_loss(
            y, tgt, gamma=t.focal_gamma, ignore_index=ignore, weight=weight
        )
    if t.loss == "tversky":
        return lambda y, tgt: tversky_loss(
            y, tgt, alpha=t.tversky_alpha, beta=t.tversky_beta, ignore_index=ignore
        )
    return lambda y, tgt: ce_dice_loss(y, tgt, ignore_index=ignore, weight=weight)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> Optimizer:
    """AdamW or SGD (with momentum) over ``model``'s trainable parameters.

    Weight decay applies to parameters with two or more dimensions only.
    """
    groups = _param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def lr_factor(step: int, cfg: ScheduleConfig, total_steps: int, peak_lr: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based) divided by ``peak_lr``.

    Linear warm-up ``(step + 1) / warmup_steps`` reaches the peak on the last warm-up step;
    afterwards ``cosine`` or ``poly`` decay from the peak to ``min_lr`` at the final step
    (``constant`` stays at the peak).
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    span = max(1, total_steps - warmup - 1)
    t = min(1.0, (step - warmup) / span)
    floor = cfg.min_lr / peak_lr
    if cfg.name == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * t))
    elif cfg.name == "poly":
        shape = (1.0 - t) ** cfg.power
    else:
        raise ValueError(f"unknown schedule {cfg.name!r}")
    return floor + (1.0 - floor) * shape


def build_scheduler(
    optimizer: Optimizer, cfg: ScheduleConfig, total_steps: int, peak_lr: float
) -> LambdaLR:
    """A per-step ``LambdaLR`` following :func:`lr_factor`.

    The factor is a plain closure on purpose: ``LambdaLR.state_dict`` then saves only the
    step counter, so a resumed run with more ``training.steps`` follows the new schedule.
    """

    def factor(step: int) -> float:
        return lr_factor(step, cfg, total_steps, peak_lr)

    return LambdaLR(optimizer, factor)


def apply_hyperparameters(optimizer: Optimizer, scheduler: LambdaLR, cfg: OptimizerConfig) -> None:
    """Put ``cfg``'s optimizer settings in force after a checkpoint was loaded.

    Loading restores the saved param groups (``lr``, ``initial_lr``, weight decay, betas or
    momentum) and the scheduler's ``base_lrs``, so a value changed on ``--resume`` would be
    written to ``config.yaml`` but not used. Overwrite them from ``cfg`` and recompute the
    current lr from the (rebuilt) schedule at the restored step, exactly as
    ``scheduler.step()`` computes it: with an unchanged config nothing changes, bit for bit.
    """
    for index, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = cfg.lr
        if index == 0:  # the decayed group (see _param_groups); the other one stays at 0
            group["weight_decay"] = cfg.weight_decay
        if "betas" in group:
            group["betas"] = tuple(cfg.betas)
        if "momentum" in group:
            group["momentum"] = cfg.momentum
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    # LambdaLR.get_lr's formula (calling it outside step() warns)
    lrs = [
        base * f(scheduler.last_epoch)
        for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() reports


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Clip the global gradient norm to ``max_norm`` (0 or None: only measure it).

    Returns the norm before clipping (may be inf/nan; the caller decides what to do).
    """
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm:
        norm = nn.utils.clip_grad_norm_(grads, max_norm, error_if_nonfinite=False)
    else:
        norm = nn.utils.get_total_norm([p.grad for p in grads])
    return float(norm)


def _checkpointed(block: nn.Module):
    """``block.forward`` through ``torch.utils.checkpoint`` (non-reentrant).

    The recomputation runs during backward, outside the parallelized model's forward and so
    outside ``SpatialMode``: it re-enters it (harmless for a plain model). It also restores
    the block's buffers afterwards, so BatchNorm running statistics are updated once per
    step, not twice.
    """
    forward = block.forward
    in_forward = [False]  # True while the checkpointed call runs during the forward
    runtime = [None]  # the model's runtime, seen in the forward (options, stats)

    def run(*args, **kwargs):
        if in_forward[0]:
            return forward(*args, **kwargs)
        saved = [b.detach().clone() for b in block.buffers()]  # recomputation in backward
        try:
            with SpatialMode(runtime[0]):
                return forward(*args, **kwargs)
        finally:
            with torch.no_grad():
                for b, s in zip(block.buffers(), saved, strict=True):
                    b.copy_(s)

    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save or recompute
            return forward(*args, **kwargs)
        in_forward[0], runtime[0] = True, current_runtime()
        try:
            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)
        finally:
            in_forward[0] = False

    return wrapped


def _param_children(m: nn.Module) -> list[nn.Module]:
    """Children of ``m`` that hold parameters (ModuleList/ModuleDict entries individually)."""
    out = []
    for c in m.children():
        if isinstance(c, (nn.ModuleList, nn.ModuleDict)):
            out += _param_children(c)
        elif any(True for _ in c.parameters()):
            out.append(c)
    return out


def _top_blocks(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "checkpoint_blocks"):
        return list(model.checkpoint_blocks())
    node = _param_children(model)
    while len(node) == 1 and _param_children(node[0]):
        node = _param_children(node[0])
    return [m for m in node if any(True for _ in m.children())]


def checkpoint_blocks(
    model: nn.Module, granularity: str = "blocks", every: int = 1
) -> list[nn.Module]:
    """The modules whose activations are recomputed.

    ``granularity="blocks"``: ``model.checkpoint_blocks()`` if the model defines it;
    otherwise the children with parameters of the first module that has more than one
    (entries of ModuleList/ModuleDict counted individually), skipping leaves. ``"layers"``:
    one level finer, each block's children with parameters (a leaf block stays whole):
    a smaller recomputation peak in the backward, more activations kept. ``every=k`` keeps
    every k-th of those (the first, the (k+1)-th, ...): less recomputation, less saving.
    """
    if granularity not in ("blocks", "layers"):
        raise ValueError(f"granularity must be 'blocks' or 'layers', got {granularity!r}")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    blocks = _top_blocks(model)
    if granularity == "layers":
        blocks = [c for b in blocks for c in (_param_children(b) or [b])]
    return blocks[::every]


def enable_activation_checkpointing(
    model: nn.Module, granularity: str = "blocks", every: int = 1
) -> list[nn.Module]:
    """Recompute the activations of ``checkpoint_blocks(model, granularity, every)`` in
    backward (saves memory, costs up to one more forward); the results are unchanged.
    Returns the modules."""
    blocks = checkpoint_blocks(model, granularity, every)
    for block in blocks:
        block.forward = _checkpointed(block)
    return blocks
