"""``unet3d``: registry, single-device shapes, and a parallelized unet3d equal to one device
(fp64, forward and every gradient; 10 SGD steps) on volumes sharded over D and over W."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import UNet3D, create_model, list_models
from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.op_check import check_module
from tests.reference import check_close, seeded


def _model(norm: str = "batch") -> torch.nn.Module:
    torch.manual_seed(0)
    opts = dict(depth=2, base_width=4, norm=norm, group_norm_groups=2)
    return create_model("unet3d", num_classes=3, in_channels=1, **opts)


def test_unet3d_registered_and_shapes() -> None:
    assert "unet3d" in list_models()
    model = _model()
    assert isinstance(model, UNet3D)
    assert model(torch.zeros(2, 1, 4, 6, 8)).shape == (2, 3, 4, 6, 8)
    assert sum(isinstance(m, torch.nn.Conv3d) for m in model.modules()) == 7
    # sizes not divisible by 2 ** (depth - 1): trilinear resize to the skip (single device)
    assert model(torch.zeros(1, 1, 5, 6, 7)).shape == (1, 3, 5, 6, 7)


def unet3d_matches(world: int, dim: int, depth_size: int, norm: str) -> list[str]:
    failures: list[str] = []
    x = seeded(7, 1, 1, depth_size, 16, 20, dtype=torch.float64)
    label = f"unet3d norm={norm} Shard({dim}) {tuple(x.shape)} world={world}"
    check_module(_model(norm).double(), x, mesh(world), [Shard(dim)], label, failures)
    return failures


@pytest.mark.parametrize(
    "world,dim,depth_size,norm",
    [
        (2, 2, 8, "batch"),  # over D
        (2, 4, 8, "group"),  # over W
        (3, 4, 8, "batch"),
        # D=8 over 3 ranks pools to D=4: DTensor chunking (2, 2, 0) leaves a rank empty
        (3, 2, 12, "batch"),
    ],
)
def test_unet3d_sharded_matches_single_device(dist_pool, world, dim, depth_size, norm):
    failures = dist_pool.run(world, unet3d_matches, world, dim, depth_size, norm)[0]
    assert not failures, "\n".join(failures)


def unet3d_sgd(world: int, dim: int, steps: int = 10) -> list[str]:
    """10 SGD steps (momentum) with a cross-entropy loss on sharded logits equal one device."""
    dmesh = mesh(world)
    x = seeded(8, 1, 1, 8, 16, 20, dtype=torch.float64)
    target = (seeded(9, 1, 8, 16, 20) > 0).long() + (seeded(10, 1, 8, 16, 20) > 1).long()
    ref = _model().double()
    par = parallelize(copy.deepcopy(ref), dmesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, par)]
    xs = distribute_tensor(x, dmesh, [Shard(dim)])
    onehot = torch.nn.functional.one_hot(target, 3).movedim(-1, 1).double()
    ts = distribute_tensor(onehot, dmesh, [Shard(dim)])
    for _ in range(steps):
        for model, opt, inp, tgt in ((ref, opts[0], x, onehot), (par, opts[1], xs, ts)):
            opt.zero_grad()
            logits = model(inp)
            # soft-target cross entropy from pointwise ops and a full sum (works on DTensors)
            loss = -(logits.log_softmax(1) * tgt).sum() / target.numel()
            loss.backward()
            opt.step()
    failures: list[str] = []
    for (name, p), pr in zip(par.named_parameters(), ref.parameters(), strict=True):
        check_close(f"SGD Shard({dim}) {name}", p, pr, 1e-9, failures)
    for (name, b), br in zip(par.named_buffers(), ref.buffers(), strict=True):
        check_close(f"SGD Shard({dim}) buffer {name}", b.double(), br.double(), 1e-9, failures)
    return failures


def test_unet3d_sgd_steps_match_single_device(dist_pool):
    failures = dist_pool.run(2, unet3d_sgd, 2, 2)[0]
    failures += dist_pool.run(3, unet3d_sgd, 3, 4)[0]
    assert not failures, "\n".join(failures)


def unet3d_too_thin(world: int) -> str:
    model = parallelize(_model(), mesh(world))
    x = distribute_tensor(seeded(7, 1, 1, 8, 6, 6), mesh(world), [Shard(2)])
    with pytest.raises(SpatialShardingError, match="empty strip") as info:
        model(x)
    return str(info.value)


def test_unet3d_too_thin_volume_is_refused_clearly(dist_pool):
    msg = dist_pool.run(3, unet3d_too_thin, 3)[0]
    assert "MaxPool3d" in msg and "parallel.sp" in msg, msg


def unet3d_dp_sp(world: int) -> list[str]:
    """(dp, sp) = (2, 2) mesh, batch 3 (uneven batch shards), volume sharded over W."""
    failures: list[str] = []
    x = seeded(11, 3, 1, 4, 6, 10, dtype=torch.float64)
    dmesh = mesh((2, 2))
    check_module(_model().double(), x, dmesh, [Shard(0), Shard(4)], "unet3d dp x sp", failures)
    return failures


def test_unet3d_on_dp_sp_mesh(dist_pool):
    failures = dist_pool.run(4, unet3d_dp_sp, 4)[0]
    assert not failures, "\n".join(failures)
