"""ConvTranspose3d on an NCDHW volume sharded along D, H or W against one device (fp64,
forward, input gradient and every parameter gradient) at 2 and 3 ranks with uneven sizes
(Conv3d: tests/test_conv_grid.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_module
from tests.reference import seeded

VOLUME_DIMS = (2, 3, 4)  # D, H, W


def _transpose_configs() -> list[dict]:
    return [
        dict(kernel_size=2, stride=2),  # the U-Net up-sampling
        dict(kernel_size=3, stride=2, padding=1, output_padding=1),
        dict(kernel_size=3, padding=1, bias=False),
        dict(kernel_size=(2, 3, 4), stride=(2, 1, 2), padding=(0, 1, 2), dilation=(1, 1, 2)),
        dict(kernel_size=4, stride=2, padding=2, groups=2, output_padding=(1, 0, 1)),
    ]


def conv_transpose3d_grid(world: int) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    for j, cfg in enumerate(_transpose_configs()):
        torch.manual_seed(j)
        conv = nn.ConvTranspose3d(4, 2, **cfg).double()
        for dim in VOLUME_DIMS:
            shape = [3, 4, 3]
            shape[dim - 2] = 3 * world - 1 if world > 1 else 4
            x = seeded(50 * j + dim, 1, 4, *shape, dtype=torch.float64)
            label = f"ConvTranspose3d {cfg} Shard({dim}) {tuple(x.shape)}"
            check_module(nn.Sequential(conv), x, dmesh, [Shard(dim)], label, failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_conv_transpose3d_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, conv_transpose3d_grid, world)[0]
    assert not failures, "\n".join(failures)
