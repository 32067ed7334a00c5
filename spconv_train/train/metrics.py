"""Segmentation metrics on width-sharded predictions: a confusion matrix summed over the mesh.

Each rank counts (target, prediction) pairs of its own strip into an int64 ``[K, K]``
matrix (no communication); one all-reduce at the end of an epoch gives the matrix of the
global batch and image, exactly the matrix one device would count on the full tensors.
Inputs follow the conventions of ``losses.py`` (DTensor logits ``[N, K, H, W]`` or
predictions ``[N, H, W]``; the target as local strip, full tensor or DTensor).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from spconv_train.parallel.extend import sharding_mesh_dims, spatial_layout

from .losses import local_target

__all__ = ["ConfusionMatrix", "metrics_from_confusion"]


def _nanmean(values: Tensor) -> float:
    present = values[~values.isnan()]
    return present.mean().item() if present.numel() else math.nan


def metrics_from_confusion(matrix: Tensor) -> dict[str, float | list[float]]:
    """Metrics of a confusion matrix ``matrix[target, prediction]`` (counts).

    Returns ``pixel_accuracy``; per class ``iou``, ``dice`` and ``class_accuracy``
    (recall); their macro means ``miou``, ``mean_dice``, ``mean_class_accuracy``; and
    ``pixels`` (the number of pixels counted). A class absent from both target and
    prediction has nan IoU and Dice and is left out of ``miou``/``mean_dice`` (so they
    average over the classes present in the target or the prediction); a class absent
    from the target has nan accuracy and is left out of ``mean_class_accuracy``. Per-class
    values are python lists (JSON-friendly; nan for absent classes)."""
    m = matrix.detach().to(torch.float64).cpu()
    tp = m.diagonal()
    in_target, in_pred = m.sum(1), m.sum(0)
    total = m.sum()
    nan = torch.full_like(tp, math.nan)

    def ratio(num: Tensor, den: Tensor) -> Tensor:
        return torch.where(den > 0, num / den.clamp(min=1), nan)

    iou = ratio(tp, in_target + in_pred - tp)
    dice = ratio(2 * tp, in_target + in_pred)
    acc = ratio(tp, in_target)
    return {
        "pixel_accuracy": (tp.sum() / total).item() if total > 0 else math.nan,
        "miou": _nanmean(iou),
        "mean_dice": _nanmean(dice),
        "mean_class_accuracy": _nanmean(acc),
        "iou": iou.tolist(),
        "dice": dice.tolist(),
        "class_accuracy": acc.tolist(),
        "pixels": int(total.item()),
    }


def _shard_groups(x: DTensor) -> tuple:
    """Process groups of the mesh dimensions that shard ``x`` (hold different pixels)."""
    mesh = x.device_mesh
    return tuple(mesh.get_group(i) for i in sharding_mesh_dims(x.placements))


class ConfusionMatrix:
    """Accumulates a ``[K, K]`` int64 confusion matrix (rows: target, columns: prediction)
    over local strips; ``reduce`` sums it over the mesh, ``metrics`` derives the scores.

    Usage on every rank::

        cm = ConfusionMatrix(num_classes, ignore_index=255)
        for batch: cm.update(logits, target_strip)     # local, no communication
        scores = cm.compute()                          # one all-reduce, then metrics()

    Pixels whose target is ``ignore_index`` are skipped. Target (or given prediction)
    labels outside ``[0, K)`` are not counted; they are reported by ``reduce`` as a
    ``ValueError`` raised on every rank together (so no rank is left waiting).
    """

    def __init__(self, num_classes: int, ignore_index: int = 255, device=None) -> None:
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.device = device
        self.reset()

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.local = torch.zeros(
            self.num_classes, self.num_classes, dtype=torch.int64, device=self.device
        )
        self.total: Tensor | None = None
        self._invalid = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._groups: tuple | None = None

    @torch.no_grad()
    def update(self, logits_or_pred: Tensor, target: Tensor) -> None:
        """Count one batch: ``logits_or_pred`` is logits ``[N, K, H, W]`` (argmax over the
        classes, taken locally) or predicted labels ``[N, H, W]``, a DTensor or a plain
        tensor; ``target`` as in ``losses.py`` (local strip, full tensor or DTensor)."""
        x = logits_or_pred
        if isinstance(x, DTensor):
            if x.ndim in (4, 5):  # logits of images (strips or tiles) or volumes
                x, _ = spatial_layout(x, "ConfusionMatrix.update", ndim=x.ndim, tiles=True)
            groups = _shard_groups(x)
            if self._groups is not None and self._groups != groups:
                raise ValueError("ConfusionMatrix.update: inputs laid out on different meshes")
            self._groups = groups
        t = local_target(target, x)
        local = x.to_local() if isinstance(x, DTensor) else x
        logits = local.ndim in (4, 5)  # volume predictions must come as logits
        pred = local.argmax(1) if logits else local
        k = self.num_classes
        if logits and local.shape[1] != k:
            raise ValueError(f"ConfusionMatrix: {local.shape[1]} logit channels != {k} classes")
        if self.local.device != t.device:
            self.local, self._invalid = self.local.to(t.device), self._invalid.to(t.device)
        keep = t != self.ignore_index
        bad = keep & ((t < 0) | (t >= k) | (pred < 0) | (pred >= k))
        self._invalid += bad.sum()
        keep &= ~bad
        index = t[keep].long() * k + pred[keep].long()
        self.local += torch.bincount(index, minlength=k * k).view(k, k)
        self.total = None

    @torch.no_grad()
    def reduce(self, groups: tuple | DeviceMesh | None = None) -> Tensor:
        """Sum the local matrices over ``groups`` (call on every rank) and return the global
        matrix, also kept as ``self.total``; the local counts are unchanged, so calling it
        again is safe. ``groups``: ``None`` = the mesh dimensions that shard the DTensor
        inputs seen by ``update`` (none for plain inputs); a ``DeviceMesh`` = all of its
        dimensions (every rank must then have counted different pixels); or a tuple of
        process groups."""
        if groups is None:
            groups = self._groups or ()
        elif isinstance(groups, DeviceMesh):
            groups = tuple(groups.get_group(i) for i in range(groups.ndim))
        packed = torch.cat([self.local.flatten(), self._invalid])
        for group in groups:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        invalid = int(packed[-1].item())
        if invalid:
            raise ValueError(
                f"ConfusionMatrix: {invalid} pixels had target or predicted labels outside "
                f"[0, {self.num_classes}) that are not ignore_index={self.ignore_index}"
            )
        self.total = packed[:-1].view_as(self.local)
        return self.total

    def metrics(self) -> dict[str, float | list[float]]:
        """``metrics_from_confusion`` of the reduced matrix (of this rank's own counts if
        ``reduce`` was not called since the last ``update``)."""
        return metrics_from_confusion(self.local if self.total is None else self.total)

    def compute(self, groups: tuple | DeviceMesh | None = None) -> dict[str, float | list[float]]:
        """``reduce(groups)`` then ``metrics()``."""
        self.reduce(groups)
        return self.metrics()
