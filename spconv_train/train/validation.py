"""Validation: the loss and metrics over every validation image, or named skips.

Every image counts in the loss and in the confusion matrix, with two exceptions, both
visible:

- an image without a labelled pixel (all ``ignore_index``) has nothing to score: its loss
  is 0 and left out of the mean (the val loss is the mean over the images with labels);
- an image that cannot be loaded (its pixels were checked finite up front, so this is a
  file changed since) or whose model output is non-finite is a bad sample
  (``data.on_bad_sample``): ``error`` stops every rank with a ``DataError`` naming it,
  ``skip`` leaves it out of the loss *and* the metrics, names it on the console and in
  ``metrics.jsonl`` (once) and counts it in ``val/skipped_images``.

The ranks holding pieces of one image agree on such a failure before its forward pass
(``agree_on_failures`` over the spatial group), so none is left waiting in a halo exchange.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from spconv_train.logging import overlay_panel
from spconv_train.parallel import ParallelDims, full_parameters, local_module
from spconv_train.train.bad_samples import (
    SkipRecord,
    agree_on_failures,
    report_skipped,
    sample_file,
    training_failure,
)
from spconv_train.train.console import validation_line
from spconv_train.train.data_feed import val_items
from spconv_train.train.metrics import ConfusionMatrix
from spconv_train.train.panels import gather_panels, panel_pieces

if TYPE_CHECKING:
    from spconv_train.train.loop import _Run

__all__ = ["log_val", "validate"]

_WHERE = "while loading a validation image"


def _non_finite(run: _Run, index: int, loss: float) -> tuple[str, str]:
    """``(file, reason)`` of an image whose model output is non-finite."""
    return sample_file(run.val_source, index), (
        f"non-finite validation loss ({loss}) although the image's pixels are finite (checked "
        "when loaded): the model overflows on it; check its value range, or lower "
        "optimizer.lr / set optimizer.grad_clip / use training.precision fp32"
    )


def _skip_or_raise(run: _Run, failures: list[tuple[str, str]], where: str) -> None:
    if run.cfg.data.on_bad_sample != "skip":
        raise training_failure(failures, where)


@torch.no_grad()
def validate(run: _Run, step: int) -> dict:
    """Metrics over the whole validation set (confusion matrix summed over the mesh), the
    mean loss over the images with labels, and ``skipped_images`` (module docstring)."""
    # The model inside a DDP wrapper: no gradient bookkeeping, no lock-step between replicas
    cfg, model, device = run.cfg, local_module(run.model), run.info.device
    k, ignore = cfg.model.num_classes, cfg.data.ignore_index
    sp_groups = tuple(run.sp_mesh.get_group(i) for i in range(run.sp_mesh.ndim))
    model.eval()
    cm = ConfusionMatrix(k, ignore, device=device)
    losses, labelled, skipped, pieces = [], [], [], []
    # With FSDP, gathered once: replicas may validate different numbers of images.
    with full_parameters(model):
        for item in val_items(run.val_source, cfg, run.coords, run.sp_mesh, device):
            run.watchdog.beat(f"step {step}: validation of image {item.index} (halo exchanges)")
            failed = agree_on_failures([item.failure] if item.failure else [], device, sp_groups)
            if failed:  # on every rank of the image together
                _skip_or_raise(run, failed, _WHERE)
                skipped += failed
                continue
            with run.autocast():
                logits = model(item.image)
            loss = float(run.loss_fn(logits, item.target))  # the same on the image's ranks
            if not math.isfinite(loss):
                failed = [_non_finite(run, item.index, loss)]
                _skip_or_raise(run, failed, "while validating")
                skipped += failed
                continue
            losses.append(loss)
            labelled.append(int((item.target != ignore).sum()))  # this rank's piece only
            cm.update(logits, item.target)
            if item.index < cfg.logging.num_val_images:
                pieces += panel_pieces(item, logits, cfg, run.coords.sp_rank)
    run.watchdog.beat(f"step {step}: validation metrics (all-reduce over the mesh)")
    cm.reduce(run.mesh)  # every rank counted different pixels: sum over the whole mesh
    counts = torch.tensor(labelled, dtype=torch.int64, device=device)
    for group in sp_groups:  # each image's labelled pixels, over all of its pieces
        dist.all_reduce(counts, group=group)
    scored = [v for v, n in zip(losses, counts.tolist(), strict=True) if n > 0]
    totals = torch.tensor(
        [sum(scored), len(scored), len(skipped)], dtype=torch.float64, device=device
    )
    dp_group = run.mesh.get_group(ParallelDims.DP)
    dist.all_reduce(totals, group=dp_group)  # losses are replicated over sp
    scores = cm.metrics()
    scores["loss"] = (totals[0] / totals[1]).item() if totals[1] > 0 else math.nan
    scores["skipped_images"] = int(totals[2])
    if scores["skipped_images"]:
        _report(run, step, skipped, dp_group)
    for index, (img, pred, tgt) in gather_panels(pieces).items():
        panel = overlay_panel(img, pred, tgt, k, ignore_index=ignore, downsample=1)
        run.logger.images(step, f"val/panel_{index}", panel)
    model.train()
    return scores


def _report(run: _Run, step: int, skipped: list[tuple[str, str]], dp_group) -> None:
    """Name the validation images skipped for the first time (every replica's)."""
    gathered: list = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(gathered, skipped, group=dp_group)
    known = {r.file for r in run.skipped if r.split == "val"}
    new = dict.fromkeys(item for part in gathered for item in part if item[0] not in known)
    records = [SkipRecord("val", file, reason, step) for file, reason in new]
    report_skipped(run.logger, records)
    run.skipped += records


def log_val(run: _Run, step: int, scores: dict) -> None:
    """The validation scores as ``val``, ``val_iou`` and ``val_dice`` scalars, and one
    console line with every class's IoU."""
    run.logger.info(validation_line(step, scores, run.class_names))
    keys = ("loss", "pixel_accuracy", "miou", "mean_dice", "mean_class_accuracy")
    values = {key: scores[key] for key in keys}
    values["skipped_images"] = scores.get("skipped_images", 0)
    run.logger.scalars(step, values, prefix="val")
    run.logger.scalars(step, dict(zip(run.class_names, scores["iou"], strict=True)), "val_iou")
    run.logger.scalars(step, dict(zip(run.class_names, scores["dice"], strict=True)), "val_dice")
