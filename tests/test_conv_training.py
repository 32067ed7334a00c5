"""Ten SGD steps of a width-sharded convolution track the single-device run step by step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

# The four layers named by issue 2 (PyTorch's own DTensor conv test trains similar ones).
LAYERS = {
    "patchify 4x4/4": dict(in_channels=3, out_channels=8, kernel_size=4, stride=4),
    "depthwise 7x7 p3": dict(in_channels=6, out_channels=6, kernel_size=7, padding=3, groups=6),
    "3x3 s2 p1": dict(in_channels=3, out_channels=5, kernel_size=3, stride=2, padding=1),
    "3x3 dilation 2": dict(in_channels=3, out_channels=4, kernel_size=3, dilation=2, padding=2),
}


def train_compare(shape: tuple[int, ...], steps: int = 10) -> list[str]:
    """Train each layer on one device and sharded with the same data; compare every step."""
    dmesh = mesh(shape)
    placements = [Shard(3)] if len(shape) == 1 else [Shard(0), Shard(3)]
    batch = 1 if len(shape) == 1 else 2 * shape[0]
    failures: list[str] = []
    for i, (name, cfg) in enumerate(LAYERS.items()):
        torch.manual_seed(i)
        ref = nn.Conv2d(**cfg)
        par = parallelize(copy.deepcopy(ref), dmesh)
        opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        opt_p = torch.optim.SGD(par.parameters(), lr=0.05, momentum=0.9)
        width = 16 * 4 + 7  # 71 columns: uneven over 2, 3 and 4 ranks
        for step in range(steps):
            x = seeded(100 * i + step, batch, cfg["in_channels"], 12, width)
            y_ref = ref(x)
            target = seeded(5000 + 100 * i + step, *y_ref.shape)
            loss_ref = ((y_ref - target) ** 2).sum() / target.numel()
            y_par = par(distribute_tensor(x, dmesh, placements))
            t_par = distribute_tensor(target, dmesh, placements)
            loss_par = ((y_par - t_par) ** 2).sum() / target.numel()  # a sum: no gather
            for opt, loss in ((opt_r, loss_ref), (opt_p, loss_par)):
                opt.zero_grad()
                loss.backward()
                opt.step()
            label = f"{name} step {step}"
            check_close(f"{label} loss", loss_par.full_tensor(), loss_ref, 1e-5, failures)
            for (pn, p), (_, q) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
                check_close(f"{label} {pn}", p, q, 1e-5, failures)
    return failures


@pytest.mark.parametrize("shape", [(1,), (2,), (3,), (4,), (2, 2)], ids=str)
def test_ten_sgd_steps_match_single_device(dist_pool, shape):
    world = 1
    for n in shape:
        world *= n
    results = dist_pool.run(world, train_compare, shape)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
