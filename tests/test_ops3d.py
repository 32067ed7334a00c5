"""3-D pooling and normalisation on an NCDHW volume sharded along D, H or W against one
device (fp64: forward, input gradient, parameter gradients, running statistics)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import check_close, seeded


def _modules() -> list[nn.Module]:
    torch.manual_seed(0)
    mods = [
        nn.MaxPool3d(2),
        nn.MaxPool3d(3, stride=2, padding=1),
        nn.MaxPool3d((2, 3, 3), stride=(1, 2, 2), padding=(1, 1, 0), dilation=(1, 2, 1)),
        nn.MaxPool3d(3, stride=2, padding=1, ceil_mode=True),
        nn.AvgPool3d(2),
        nn.AvgPool3d(3, stride=2, padding=1),
        nn.AvgPool3d(3, stride=2, padding=1, count_include_pad=False),
        nn.AvgPool3d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.AvgPool3d(2, stride=2, ceil_mode=True),
        nn.AvgPool3d(3, stride=2, padding=1, divisor_override=5),
        nn.BatchNorm3d(4),
        nn.BatchNorm3d(4, affine=False, momentum=None),
        nn.InstanceNorm3d(4, affine=True, track_running_stats=True),
        nn.GroupNorm(2, 4),
    ]
    for m in mods:  # non-trivial affine parameters
        for p in m.parameters():
            nn.init.normal_(p)
    return [m.double() for m in mods]


def ops3d_grid(world: int) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    for j, module in enumerate(_modules()):
        # one sharded dim per module, rotating with the world size: the 2-4 rank tests
        # together shard every module along D, H and W
        for dim in ((j + world) % 3 + 2,):
            shape = [5, 6, 4]
            shape[dim - 2] = 6 * world - 1 - j % 2  # uneven, odd and even sizes
            x = seeded(10 * j + dim, 2 if j % 2 else 1, 4, *shape, dtype=torch.float64)
            label = f"{module} Shard({dim}) {tuple(x.shape)}"
            before = len(failures)
            check_module(nn.Sequential(module), x, dmesh, [Shard(dim)], label, failures)
            if len(failures) == before and list(module.buffers()):
                _check_buffers(module, x, dmesh, dim, label, failures)
    return failures


def _check_buffers(module, x, dmesh, dim, label, failures) -> None:
    """Running statistics after one training forward equal one device's."""
    ref = copy.deepcopy(module)
    par = parallelize(nn.Sequential(copy.deepcopy(module)), dmesh)
    ref(x)
    par(distribute_tensor(x, dmesh, [Shard(dim)]))
    for (name, b), rb in zip(par.named_buffers(), ref.buffers(), strict=True):
        check_close(f"{label} buffer {name}", b.double(), rb.double(), 1e-10, failures)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ops3d_match_single_device(dist_pool, world):
    failures = dist_pool.run(world, ops3d_grid, world)[0]
    assert not failures, "\n".join(failures)


def functional_ops3d(world: int) -> list[str]:
    """``F.max_pool3d``/``F.avg_pool3d`` called from model code are routed too; indices refused."""
    failures: list[str] = []
    dmesh = mesh(world)
    x = seeded(3, 1, 2, 5, 4 * world + 1, 6, dtype=torch.float64)
    fns = {
        "F.max_pool3d": lambda t: nn.functional.max_pool3d(t, 3, 2, 1),
        "torch.max_pool3d": lambda t: torch.max_pool3d(t, 2),
        "F.avg_pool3d": lambda t: nn.functional.avg_pool3d(t, 3, 1, 1, False, False),
    }
    for label, fn in fns.items():
        check_fn(fn, x, dmesh, [Shard(3)], label, failures)
    model = parallelize(nn.Sequential(nn.MaxPool3d(2, return_indices=True)), dmesh)
    with pytest.raises(SpatialShardingError, match="return_indices"):
        model(distribute_tensor(x, dmesh, [Shard(3)]))
    return failures


def test_functional_ops3d(dist_pool):
    assert not dist_pool.run(2, functional_ops3d, 2)[0]
