"""Training: losses and metrics on width-sharded tensors (the loop lives beside them)."""

from spconv_train.train.losses import (
    LossInfo,
    ce_dice_loss,
    cross_entropy,
    dice_loss,
    dice_loss_reference,
    local_target,
    replicated_sum,
    shard_like,
)
from spconv_train.train.metrics import ConfusionMatrix, metrics_from_confusion
from spconv_train.train.rare_class_losses import (
    focal_loss,
    focal_loss_reference,
    tversky_loss,
    tversky_loss_reference,
)

__all__ = [
    "ConfusionMatrix",
    "LossInfo",
    "ce_dice_loss",
    "cross_entropy",
    "dice_loss",
    "dice_loss_reference",
    "focal_loss",
    "focal_loss_reference",
    "local_target",
    "metrics_from_confusion",
    "replicated_sum",
    "shard_like",
    "tversky_loss",
    "tversky_loss_reference",
]
