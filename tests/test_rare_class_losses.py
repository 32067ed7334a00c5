"""Focal and Tversky references against independent definitions (their sharded forms are
checked against these references in tests/test_losses.py's grid), and the config route."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from spconv_train.config import load_config
from spconv_train.train import (
    dice_loss_reference,
    focal_loss,
    focal_loss_reference,
    tversky_loss,
    tversky_loss_reference,
)
from spconv_train.train.optim import build_loss
from tests.reference import seeded

K = 4
WEIGHT = torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=torch.float64)


def _data(seed: int, n: int = 2, h: int = 3, w: int = 5):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, K, (n, h, w), generator=g)
    t = t.masked_fill(torch.rand(n, h, w, generator=g) < 0.25, 255)
    return seeded(seed, n, K, h, w).double() * 2, t


def test_focal_with_gamma_0_is_weighted_cross_entropy():
    x, t = _data(1)
    want = F.cross_entropy(x, t, weight=WEIGHT, ignore_index=255)
    got = focal_loss_reference(x, t, gamma=0.0, weight=WEIGHT)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


def test_focal_known_value_by_hand():
    # one pixel of class 1 with probabilities (0.2, 0.5, 0.3): -(1 - 0.5)^2 log 0.5
    x = torch.log(torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)).view(1, 3, 1, 1)
    t = torch.tensor([[[1]]])
    assert math.isclose(float(focal_loss_reference(x, t)), 0.25 * math.log(2), rel_tol=1e-12)
    # a second, ignored pixel changes nothing; a weighted mean divides by the weights
    x2 = torch.cat([x, x], 3)
    t2 = torch.tensor([[[1, 255]]])
    assert math.isclose(float(focal_loss(x2, t2)), 0.25 * math.log(2), rel_tol=1e-12)


def test_tversky_with_equal_weights_is_dice_with_twice_the_smoothing():
    x, t = _data(2)
    want = dice_loss_reference(x, t, smooth=2.0)
    got = tversky_loss_reference(x, t, alpha=0.5, beta=0.5, smooth=1.0)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert torch.allclose(tversky_loss(x, t, alpha=0.5, beta=0.5), want, rtol=1e-12, atol=0)


def test_tversky_known_value_by_hand():
    # two classes, three pixels; class-1 probabilities 0.9, 0.2, 0.6 against labels 1, 1, 0:
    # TP = 0.9 + 0.2, FP = 0.6, FN = 0.1 + 0.8 (class 1 only: include_background=False)
    p1 = torch.tensor([0.9, 0.2, 0.6], dtype=torch.float64)
    x = torch.log(torch.stack([1 - p1, p1])).view(1, 2, 1, 3)
    t = torch.tensor([[[1, 1, 0]]])
    tp, fp, fn = 1.1, 0.6, 0.9
    for alpha, beta in ((0.3, 0.7), (0.7, 0.3)):
        want = 1 - (tp + 1) / (tp + alpha * fp + beta * fn + 1)
        got = tversky_loss_reference(x, t, alpha=alpha, beta=beta, include_background=False)
        assert math.isclose(float(got), want, rel_tol=1e-12)
    # more misses than false alarms here: weighing misses (beta) costs more
    heavy_fn = tversky_loss_reference(x, t, alpha=0.3, beta=0.7, include_background=False)
    heavy_fp = tversky_loss_reference(x, t, alpha=0.7, beta=0.3, include_background=False)
    assert float(heavy_fn) > float(heavy_fp)


def test_all_ignored_batch_gives_zero_focal_loss_and_gradient():
    x = seeded(3, 1, K, 2, 3).requires_grad_()
    loss = focal_loss(x, torch.full((1, 2, 3), 255))
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().sum() == 0


def test_config_selects_the_losses(tmp_path):
    x, t = _data(4)
    for name, ref in (
        ("focal", lambda: focal_loss_reference(x, t, gamma=1.0, weight=WEIGHT)),
        ("tversky", lambda: tversky_loss_reference(x, t, alpha=0.4, beta=0.8)),
    ):
        overrides = [
            f"training.loss={name}",
            "training.focal_gamma=1.0",
            "training.tversky_alpha=0.4",
            "training.tversky_beta=0.8",
            f"model.num_classes={K}",
            "training.class_weights=[0.5, 2.0, 1.0, 1.5]",
        ]
        cfg = load_config("configs/unet.yaml", overrides)
        got = build_loss(cfg, torch.device("cpu"))(x, t)
        assert torch.allclose(got, ref(), rtol=1e-12, atol=0), name
