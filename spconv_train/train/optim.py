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
from spconv_train.parallel import SpatialMode, current_runtime
from spconv_train.train.losses import ce_dice_loss, cross_entropy, dice_loss

__all__ = [
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
    """``loss(logits, target_strip)`` for ``training.loss`` (ce, dice or ce+dice), with
    ``training.class_weights`` and ``data.ignore_index``; a global mean on every rank."""
    t, ignore = cfg.training, cfg.data.ignore_index
    weight = None if t.class_weights is None else torch.tensor(t.class_weights, device=device)
    if t.loss == "ce":
        return lambda y, tgt: cross_entropy(y, tgt, ignore_index=ignore, weight=weight)
    if t.loss == "dice":
        return lambda y, tgt: dice_loss(y, tgt, ignore_index=ignore)
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


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks whose activations are recomputed: ``model.checkpoint_blocks()`` if the
    model defines it; otherwise the children with parameters of the first module that has
    more than one (entries of ModuleList/ModuleDict counted individually), skipping leaves."""
    if hasattr(model, "checkpoint_blocks"):
        return list(model.checkpoint_blocks())

    def kids(m: nn.Module) -> list[nn.Module]:
        out = []
        for c in m.children():
            if isinstance(c, (nn.ModuleList, nn.ModuleDict)):
                out += kids(c)
            elif any(True for _ in c.parameters()):
                out.append(c)
        return out

    node = kids(model)
    while len(node) == 1 and kids(node[0]):
        node = kids(node[0])
    return [m for m in node if any(True for _ in m.children())]


def enable_activation_checkpointing(model: nn.Module) -> list[nn.Module]:
    """Recompute the activations of ``checkpoint_blocks(model)`` in backward (saves memory,
    costs about one more forward); the results are unchanged. Returns the blocks."""
    blocks = checkpoint_blocks(model)
    for block in blocks:
        block.forward = _checkpointed(block)
    return blocks
