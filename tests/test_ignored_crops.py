"""A crop whose mask is all ``ignore_index`` is not an error (issue 21, item 3).

Sparse labels leave crops (or a rank's strip of a crop) without a labelled pixel. Such a
crop contributes nothing: the loss over a batch with no labelled pixel is 0 with a zero
gradient on every rank (torch's mean gives nan, which stopped training with "non-finite
loss"), and a strip without labels next to strips with labels still gives the one-device
loss and gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import parallelize
from spconv_train.train import ce_dice_loss, cross_entropy, dice_loss, dice_loss_reference
from spconv_train.train.step import train_step
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

K, H, W, IGNORE = 4, 3, 8, 255
LOSSES = {
    "ce": (cross_entropy, lambda x, t: F.cross_entropy(x, t, ignore_index=IGNORE)),
    "dice": (dice_loss, dice_loss_reference),
    "ce+dice": (
        ce_dice_loss,
        lambda x, t: F.cross_entropy(x, t, ignore_index=IGNORE) + dice_loss_reference(x, t),
    ),
}


def _strip(t: torch.Tensor, dmesh) -> torch.Tensor:
    return distribute_tensor(t, dmesh, [Shard(2)], src_data_rank=None).to_local()


def ignored_strips() -> list[str]:
    """On every rank of a width-sharded mesh: (1) the last rank's strip holds only ignored
    pixels, the others hold labels: loss and gradient equal one device; (2) every pixel is
    ignored: loss 0, gradient 0, on every rank; (3) a training step on such a batch runs."""
    world = torch.distributed.get_world_size()
    dmesh = mesh(world)
    failures: list[str] = []
    x = seeded(3, 2, K, H, W) * 2
    labels = torch.randint(0, K, (2, H, W), generator=torch.Generator().manual_seed(4))
    last = W - W // world  # the columns of the last rank's strip
    partial = labels.clone()
    partial[..., last:] = IGNORE
    partial[1] = IGNORE  # the second crop has no label at all
    for name, (fn, ref_fn) in LOSSES.items():
        xr = x.clone().requires_grad_()
        want = ref_fn(xr, partial)
        want.backward()
        xs = distribute_tensor(x, dmesh, [Shard(3)], src_data_rank=None).requires_grad_()
        got = fn(xs, _strip(partial, dmesh))
        got.backward()
        check_close(f"{name} one strip ignored: loss", got, want, 1e-5, failures)
        want_grad = distribute_tensor(xr.grad, dmesh, [Shard(3)], src_data_rank=None)
        check_close(f"{name} one strip ignored: grad", xs.grad.to_local(), want_grad.to_local(),
                    1e-5, failures)  # fmt: skip

        xs = distribute_tensor(x, dmesh, [Shard(3)], src_data_rank=None).requires_grad_()
        got = fn(xs, _strip(torch.full((2, H, W), IGNORE), dmesh))
        got.backward()
        if not (got.item() == 0.0 and float(xs.grad.to_local().abs().sum()) == 0.0):
            failures.append(f"{name} all ignored: loss {got.item()}, |grad| "
                            f"{float(xs.grad.to_local().abs().sum())}")  # fmt: skip

    torch.manual_seed(0)
    model = parallelize(nn.Conv2d(3, K, 3, padding=1), dmesh)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    image = distribute_tensor(seeded(5, 2, 3, H, W), dmesh, [Shard(3)], src_data_rank=None)
    done = train_step(
        model,
        image,
        _strip(torch.full((2, H, W), IGNORE), dmesh),
        lambda y, t: ce_dice_loss(y, t, ignore_index=IGNORE),
        optimizer,
        scheduler,
        params=list(model.parameters()),
        grad_clip=None,
        step=0,
    )
    if done.loss != 0.0 or done.grad_norm != 0.0:
        failures.append(f"step on an all-ignored batch: loss {done.loss}, grad {done.grad_norm}")
    for p, q in zip(model.parameters(), before, strict=True):  # plain SGD: nothing moves
        check_close("weights after an all-ignored step", p.detach(), q, 0.0, failures)
    return failures


def test_all_ignored_crop_is_zero_loss_on_every_rank(dist_pool):
    for failures in dist_pool.run(2, ignored_strips):
        assert failures == []


def test_all_ignored_crop_is_zero_loss_on_one_device():
    x = seeded(1, 1, K, H, W).requires_grad_()
    target = torch.full((1, H, W), IGNORE)
    for name, (fn, _) in LOSSES.items():
        loss = fn(x, target)
        loss.backward()
        assert loss.item() == 0.0, name
        assert float(x.grad.abs().sum()) == 0.0, name
        x.grad = None
