"""Losses for thin and rare classes (focal, Tversky) on sharded logits, equal to one device.

Same conventions as ``losses.py`` (logits a DTensor laid out by the spatial ops or a plain
tensor, the target as this rank's strip, the full target or a DTensor; one all-reduce of
global sums with an identity backward, so ``loss.backward()`` on every rank gives every
logits strip its single-device gradient). The ``*_reference`` functions are the plain
single-device definitions the sharded ones reproduce.

* Focal loss (Lin et al., "Focal Loss for Dense Object Detection"), multi-class: per valid
  pixel ``-w_t (1 - p_t)^gamma log p_t`` with ``p_t`` the softmax probability of the
  target class and ``w_t`` its class weight; the weighted mean over the valid pixels of the
  global batch (``gamma = 0`` is ``F.cross_entropy`` with ``weight``). Easy pixels of the
  dominant class count less, so thin structures weigh more.
* Tversky loss (Salehi et al., "Tversky loss function for image segmentation using 3D
  fully convolutional deep networks"): per class
  ``TI_c = (TP + s) / (TP + alpha FP + beta FN + s)`` on soft counts over the valid pixels,
  loss ``1 - mean_c TI_c``. ``beta > alpha`` penalises missed pixels more than false
  alarms (recall of rare classes); ``alpha = beta = 0.5`` is the Dice loss with smooth
  ``2 s``. It uses the Dice loss's per-class sums (``class_sums``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spconv_train.train.losses import (
    _consts,
    _label_masks,
    _low_precision,
    _raise_if_bad,
    _strips,
    class_sums,
    class_sums_reference,
    overlap_loss,
    replicated_sum,
)

__all__ = ["focal_loss", "focal_loss_reference", "tversky_loss", "tversky_loss_reference"]


def _focal_terms(x: Tensor, t: Tensor, valid: Tensor, gamma: float, weight) -> tuple:
    """(sum over valid pixels of ``w_t (1 - p_t)^gamma (-log p_t)``, sum of ``w_t``) of
    logits ``x`` ``[N, K, ...]`` and labels ``t`` (ignored pixels hold any class)."""
    logp = F.log_softmax(x, 1).gather(1, t.unsqueeze(1)).squeeze(1)
    term = -((1.0 - logp.exp()).pow(gamma) * logp)
    w = valid.to(x.dtype)
    if weight is not None:
        w = w * weight.to(x.dtype)[t]
    return (term * w).sum(), w.sum()


def focal_loss(
    logits: Tensor,
    target: Tensor,
    *,
    gamma: float = 2.0,
    ignore_index: int = 255,
    weight: Tensor | None = None,
) -> Tensor:
    """Multi-class focal loss (module docstring), equal to ``focal_loss_reference`` on the
    full tensors: a plain scalar with the same value on every rank. A batch without a
    valid pixel (all ``ignore_index``) gives 0 with a zero gradient, as ``cross_entropy``."""
    what = "focal_loss"
    s = _strips(logits, target, what)
    x = _low_precision(s.logits)
    k = x.shape[1]
    if s.target is None:
        num, den, bad = x.sum() * 0.0, 0.0, 0.0  # keeps the graph; the error is raised below
    else:
        valid, bad_mask = _label_masks(s.target, k, ignore_index)
        t = s.target.masked_fill(~valid, 0)
        num, den = _focal_terms(x, t, valid, gamma, weight)
        bad = bad_mask.sum()
    stats = torch.cat([num.double().reshape(1), _consts(x.device, den, bad, s.target is None)])
    total = replicated_sum(stats, s.groups)
    _raise_if_bad(total[2:].detach().tolist(), s, what, k, ignore_index)
    den_total = float(total[1].detach())
    return (total[0] if den_total == 0 else total[0] / den_total).to(x.dtype)


def focal_loss_reference(
    logits: Tensor,
    target: Tensor,
    *,
    gamma: float = 2.0,
    ignore_index: int = 255,
    weight: Tensor | None = None,
) -> Tensor:
    """Single-device focal loss on plain full tensors (nan when every pixel is ignored)."""
    valid = target != ignore_index
    num, den = _focal_terms(logits, target.masked_fill(~valid, 0), valid, gamma, weight)
    return num / den


def _tversky(sums: Tensor, k: int, alpha: float, beta: float, smooth: float) -> Tensor:
    tp, psum, count = sums[:k], sums[k : 2 * k], sums[2 * k :]
    fp, fn = psum - tp, count - tp
    return (tp + smooth) / (tp + alpha * fp + beta * fn + smooth)


def tversky_loss(
    logits: Tensor,
    target: Tensor,
    *,
    alpha: float = 0.3,
    beta: float = 0.7,
    smooth: float = 1.0,
    ignore_index: int = 255,
    include_background: bool = True,
) -> Tensor:
    """Soft multi-class Tversky loss (module docstring), equal to
    ``tversky_loss_reference`` on the full tensors: a plain scalar with the same value on
    every rank (one all-reduce of ``3K`` sums, shared with the Dice loss)."""
    sums, k, dtype = class_sums(logits, target, ignore_index, "tversky_loss")
    return overlap_loss(_tversky(sums, k, alpha, beta, smooth), include_background).to(dtype)


def tversky_loss_reference(
    logits: Tensor,
    target: Tensor,
    *,
    alpha: float = 0.3,
    beta: float = 0.7,
    smooth: float = 1.0,
    ignore_index: int = 255,
    include_background: bool = True,
) -> Tensor:
    """Single-device Tversky loss on plain full tensors: one-hot targets, ignored pixels
    removed from every count (``class_sums_reference``)."""
    sums = class_sums_reference(logits, target, ignore_index)
    ti = _tversky(sums, logits.shape[1], alpha, beta, smooth)
    return overlap_loss(ti, include_background)
