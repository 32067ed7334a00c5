"""Volumes in training (issue 12 item 3): losses and metrics on sharded 5-D logits against
one device, ``verify`` on a 3-D config split over D and over H, and ``spconv-train run`` of
``configs/unet3d.yaml`` under a real torchrun with 2 ranks."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.train import ConfusionMatrix, cross_entropy, dice_loss, dice_loss_reference
from tests.dist_harness import mesh
from tests.reference import seeded
from tests.test_train_e2e import exported, ok, read_metrics, torchrun

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


def test_run_unet3d_config_under_torchrun(tmp_path):
    """``configs/unet3d.yaml`` (tiny sizes) on 2 ranks: the loss goes down on a repeated
    volume, checkpoints, model.pt and TensorBoard scalars and middle-slice panels exist."""
    run_dir = tmp_path / "run3d"
    ok(
        torchrun(
            "configs/unet3d.yaml",
            *("--set", f"run_dir={run_dir}", "--set", "model.kwargs={depth: 2, base_width: 4}"),
            *("--set", "data.depth=8", "--set", "data.height=8", "--set", "data.width=16"),
            *("--set", "data.num_train=1", "--set", "data.num_val=1", "--set", "data.hflip=0"),
            *("--set", "training.steps=6", "--set", "training.val_every=3"),
            *("--set", "training.log_every=1", "--set", "checkpoint.every=3"),
            *("--set", "schedule.name=constant", "--set", "schedule.warmup_steps=0"),
            *("--set", "logging.progress=false"),
        )
    )
    train = [m for m in read_metrics(run_dir) if m["split"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    assert train[-1]["loss"] < train[0]["loss"], [m["loss"] for m in train]
    assert all(m["halo_s_per_step"] > 0 for m in train)  # the two ranks exchanged halos
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000003", "step-000006"]
    meta = json.loads((run_dir / "checkpoints" / "step-000006" / "meta.json").read_text())
    assert meta["shared"]["data"]["epoch"] >= 0
    model = create_model("unet3d", num_classes=4, in_channels=1, depth=2, base_width=4)
    model.load_state_dict(exported(run_dir))
    from spconv_train.config import load_config

    saved = load_config(run_dir / "config.yaml")
    assert (saved.data.kind, saved.parallel.shard_dim, saved.data.depth) == ("volume", "W", 8)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "val/miou", "val/loss"} <= set(acc.Tags()["scalars"])
    panels = {t: acc.Images(t)[-1] for t in acc.Tags()["images"]}
    # the middle D slice (H x W = 8 x 16) and the middle H slice (D x W = 8 x 16), each as
    # input | prediction | label with 2-pixel gaps, stitched from both ranks' blocks
    assert set(panels) == {"val/panel_0_D4", "val/panel_0_H4"}, set(panels)
    for p in panels.values():
        assert (p.height, p.width) == (8, 3 * 16 + 2 * 2)
    # predict takes volumes (tests/test_predict_tiles.py) but not in bands: refused, exit 2
    from typer.testing import CliRunner

    from spconv_train.cli import app

    args = ["predict", str(run_dir), str(tmp_path), "--out", "x", "--band-rows", "8"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "volumes are predicted whole" in refused.output
