"""MONAI's SwinUNETR in 2-D (Swin window attention, patch merging, shifted windows, a conv
decoder with instance norm) sharded along W at 2 and 3 ranks equals one device in fp64:
output and every parameter gradient, with no activation-sized collective."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import CommAudit, parallelize
from tests.dist_harness import mesh
from tests.reference import rel_err, seeded

TOL = 1e-10


def swinunetr_failures(h: int, w: int) -> list[str]:
    from monai.networks.nets import SwinUNETR

    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)  # the same random weights on every rank (the reference's too)
    model = SwinUNETR(
        in_channels=3,
        out_channels=2,
        feature_size=12,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 1, 1),
        window_size=4,
        spatial_dims=2,
        norm_name="instance",
    ).double()
    x = seeded(1, 1, 3, h, w, dtype=torch.float64)
    gy = seeded(2, 1, 2, h, w, dtype=torch.float64)
    par = parallelize(copy.deepcopy(model), dmesh)
    xs, gys = (distribute_tensor(t, dmesh, [Shard(3)]) for t in (x, gy))
    with CommAudit() as audit:
        y = par(xs)
        y.backward(gys)
    ref = model(x)
    ref.backward(gy)
    failures = []
    if (e := rel_err(y.full_tensor(), ref)) > TOL:
        failures.append(f"output: {e:.3g}")
    got = dict(par.named_parameters())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    floor = 1e-4 * max(float(g.abs().max()) for g in grads.values())
    for name, g in grads.items():
        if (e := rel_err(got[name].grad, g, floor)) > TOL:
            failures.append(f"grad {name}: {e:.3g}")
    shapes = {tuple(p.shape) for p in model.parameters()}
    moved = audit.activation_sized(max(8, 12 * h * w // dist.get_world_size() // 4), shapes)
    failures += [f"gathered activation: {r.op} {r.shape}" for r in moved]
    return failures


@pytest.mark.parametrize("world, width", [(2, 96), (3, 160)])
def test_swinunetr_2d_matches_single_device(dist_pool, world, width):
    pytest.importorskip("einops")
    pytest.importorskip("monai")
    # W / 32 = 3 and 5 columns at the deepest stage: 2 + 1 and 2 + 2 + 1, uneven
    for rank, failures in enumerate(dist_pool.run(world, swinunetr_failures, 32, width)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
