"""Volumes in training (issue 12 item 3): losses and metrics on sharded 5-D logits against
one device and ``verify`` on a 3-D config split over D and over H. Training of
``configs/unet3d.yaml`` at 4 ranks (H and W split):
``tests/test_grid_auto.py::test_run_volume_with_sp_0_splits_h_and_w``."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.train import ConfusionMatrix, cross_entropy, dice_loss, dice_loss_reference
from tests.dist_harness import mesh
from tests.reference import seeded

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

K = 4
WEIGHT = torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=torch.float64)
SHAPE = (2, K, 5, 6, 7)  # D, H, W split unevenly over 2 and 3 ranks


def _target(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, _, *dhw = SHAPE
    t = torch.randint(0, K, (n, *dhw), generator=g)
    return t.masked_fill(torch.rand(n, *dhw, generator=g) < 0.2, 255)


def _loss_checks(world: int) -> list[str]:
    """cross_entropy, dice_loss and the confusion matrix on logits split along D, H and W:
    values, and the input gradient of every rank's block, against the full tensors."""
    fails = []
    full, target = seeded(7, *SHAPE).double(), _target(7)
    losses = (
        (
            "ce",
            lambda x, t: cross_entropy(x, t, weight=WEIGHT),
            lambda x, t: F.cross_entropy(x, t, weight=WEIGHT, ignore_index=255),
        ),
        ("dice", dice_loss, dice_loss_reference),
    )
    rank = torch.distributed.get_rank()
    for dim in (2, 3, 4):
        for name, sharded, reference in losses:
            ref_x = full.clone().requires_grad_()
            ref = reference(ref_x, target)
            ref.backward()
            x = distribute_tensor(full, mesh(world), [Shard(dim)]).requires_grad_()
            loss = sharded(x, target)  # the full target: each rank takes its block
            loss.backward()
            want = torch.chunk(ref_x.grad, world, dim)[rank]
            if not torch.allclose(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-12):
                fails.append(f"{name} dim {dim}: {float(loss)} != {float(ref)}")
            if not torch.allclose(x.grad.to_local(), want, rtol=1e-10, atol=1e-12):
                fails.append(f"{name} dim {dim}: input gradient differs")
        cm = ConfusionMatrix(K)
        cm.update(distribute_tensor(full, mesh(world), [Shard(dim)]), target)
        ref_cm = ConfusionMatrix(K)
        ref_cm.update(full, target)
        if not torch.equal(cm.reduce(), ref_cm.reduce()):
            fails.append(f"confusion matrix dim {dim} differs")
    return fails


@pytest.mark.parametrize("world", [3])  # uneven along every dim: 5, 6, 7 over 3
def test_volume_losses_and_metrics_match_single_device(dist_pool, world):
    fails = [f for r, fs in enumerate(dist_pool.run(world, _loss_checks, world)) for f in fs]
    assert not fails, "\n".join(fails)


TINY3D = [
    "data.kind=volume",
    "model.name=unet3d",
    "model.in_channels=1",
    "model.num_classes=3",
    "model.kwargs={depth: 2, base_width: 4}",
    "data.depth=8",
    "data.height=8",
    "data.width=12",
    "data.num_train=3",
    "data.num_val=1",
    "data.vflip=0.5",
    "schedule.warmup_steps=1",
    "run_dir=/nonexistent/verify-never-written",
]


def _verify_volumes(cases: list[list[str]]) -> list[dict]:
    from rich.console import Console

    from spconv_train.config import load_config
    from spconv_train.verify import run_verify

    out = []
    for overrides in cases:
        report = run_verify(
            load_config(None, TINY3D + overrides),
            steps=2,
            console=Console(file=io.StringIO(), width=150),
        )
        out.append(report.to_dict())
    return out


def test_verify_passes_on_volumes_split_over_d_and_h(dist_pool):
    cases = [
        ["parallel.shard_dim=D", "training.loss=ce+dice"],
        ["parallel.shard_dim=H", "data.batch_size=2"],
    ]
    reports = dist_pool.run(2, _verify_volumes, cases)[0]
    for case, report in zip(cases, reports, strict=True):
        assert report["passed"], (case, report["verdict"], report["failures"][:5])
        assert report["batch_shape"][1:] == [1, 8, 8, 12], report["batch_shape"]
        assert report["activation_sized_collectives"] == []
