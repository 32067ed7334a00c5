"""10-step training equality (issue 12 "Done when"): the U-Net on a 2 x 2 (sp_h, sp_w) tile
mesh and ``unet3d`` split over D and over (H, W) train 10 optimizer steps through the
trainer's own step function (``train/step.py`` ``train_step``: forward, loss, backward,
gradient clipping, optimizer and schedule step) exactly as one device does: fp64, BatchNorm
in training mode, seeded random batches (a new one per step, some pixels ignored), sizes
that do not split evenly. Compared after every step: the loss and the gradient norm; at the
end: every parameter and every BatchNorm buffer, within 1e-9; no activation-sized
collective in any step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from tests.dist_harness import mesh
from tests.reference import check_close, seeded

TOL = 1e-9

#: label -> (model, mesh shape, mesh dim names, placements, input size, model options,
#: optimizer, gradient clipping)
CASES = {
    "unet 2x2 tiles, Adam": (
        "unet",
        (2, 2),
        ("sp_h", "sp_w"),
        [Shard(2), Shard(3)],
        (18, 21),
        dict(depth=2, base_width=4, up="transpose"),
        "adam",
        None,
    ),
    "unet3d over D (3 ranks), SGD momentum": (
        "unet3d",
        (3,),
        ("sp",),
        [Shard(2)],
        (14, 6, 8),  # D 14 over 3 = (5, 5, 4), pooled 7 = (3, 3, 1)
        dict(depth=2, base_width=4, up="transpose"),
        "sgd",
        0.5,  # clips: the global gradient norm of the parameters on every rank
    ),
    "unet3d over (H, W) 2x2, Adam": (
        "unet3d",
        (2, 2),
        ("sp_h", "sp_w"),
        [Shard(3), Shard(4)],
        (6, 10, 13),  # W 13 = (7, 6), pooled 6: trilinear resize to the skip
        dict(depth=2, base_width=4, up="bilinear"),
        "adam",
        None,
    ),
}


def _optimizer(name: str, model: torch.nn.Module):
    if name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # a decaying learning rate: the scheduler step of train_step is exercised too
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))


def train_ten_steps(label: str, steps: int = 10) -> list[str]:
    """Train ``CASES[label]`` on one device and sharded with ``train_step``; compare."""
    from spconv_train.models import create_model
    from spconv_train.parallel import CommAudit, parallelize
    from spconv_train.train import cross_entropy
    from spconv_train.train.step import train_step

    name, shape, names, pl, size, opts, opt_name, clip = CASES[label]
    dmesh = mesh(shape, names)
    torch.manual_seed(0)
    in_ch = 1 if name == "unet3d" else 3
    ref = create_model(name, num_classes=3, in_channels=in_ch, **opts).double()
    par = parallelize(copy.deepcopy(ref), dmesh)
    (opt_r, sched_r), (opt_p, sched_p) = _optimizer(opt_name, ref), _optimizer(opt_name, par)
    shapes = {tuple(p.shape) for p in par.parameters()}
    failures: list[str] = []
    for step in range(steps):
        x = seeded(100 + step, 2, in_ch, *size, dtype=torch.float64)
        g = torch.Generator().manual_seed(200 + step)
        target = torch.randint(0, 3, (2, *size), generator=g)
        target[:, :2, :3] = 255  # ignored pixels / voxels
        xs = distribute_tensor(x, dmesh, pl)
        with CommAudit() as audit:  # halo exchanges and small reductions only
            done_p = train_step(
                par,
                xs,
                target,
                lambda y, t: cross_entropy(y, t, ignore_index=255),
                opt_p,
                sched_p,
                params=list(par.parameters()),
                grad_clip=clip,
                step=step,
            )
        moved = audit.activation_sized(max(1, xs.to_local()[0].numel() // 4), shapes)
        failures += [f"{label} step {step}: activation-sized {r.op} {r.shape}" for r in moved]
        done_r = train_step(
            ref,
            x,
            target,
            lambda y, t: F.cross_entropy(y, t, ignore_index=255),
            opt_r,
            sched_r,
            params=list(ref.parameters()),
            grad_clip=clip,
            step=step,
        )
        for what in ("loss", "grad_norm", "lr"):
            got, want = getattr(done_p, what), getattr(done_r, what)
            check_close(
                f"{label} step {step} {what}", torch.tensor(got), torch.tensor(want), TOL, failures
            )
        check_close(f"{label} step {step} logits", done_p.logits, done_r.logits, TOL, failures)
    for (n, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
        check_close(f"{label} {n} after {steps} steps", p, q, TOL, failures)
    buffers = list(zip(par.named_buffers(), ref.buffers(), strict=True))
    for (n, b), c in buffers:
        if b.is_floating_point():
            check_close(f"{label} buffer {n} after {steps} steps", b, c, TOL, failures)
        elif not torch.equal(b, c):  # num_batches_tracked
            failures.append(f"{label} buffer {n}: {b.tolist()} != {c.tolist()}")
    return failures[:20]


@pytest.mark.parametrize("label", list(CASES))
def test_ten_training_steps_match_single_device(dist_pool, label):
    world = 1
    for n in CASES[label][1]:
        world *= n
    for rank, failures in enumerate(dist_pool.run(world, train_ten_steps, label)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
