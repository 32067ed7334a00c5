"""Conv3d on an NCDHW volume sharded along D, H or W against one device (fp64, forward,
input gradient and every parameter gradient) at 1-4 ranks with uneven sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded

VOLUME_DIMS = (2, 3, 4)  # D, H, W


def _conv3d_configs() -> list[dict]:
    """Every Conv2d configuration of tests/test_conv.py, in 3-D (a smaller grid)."""
    cfgs = [
        dict(kernel_size=1),
        dict(kernel_size=3, padding=1),
        dict(kernel_size=4, padding="same"),  # even kernel: one more at the end
        dict(kernel_size=2, padding="valid", bias=False),
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=2, stride=2),  # patchify
        dict(kernel_size=(3, 5, 3), stride=(3, 2, 2), padding=(1, 2, 0)),
        dict(kernel_size=3, dilation=2, padding=2),
        dict(kernel_size=(2, 3, 4), dilation=(2, 1, 3), padding="same"),
        dict(kernel_size=3, padding=1, groups=2, out_channels=4),
        dict(kernel_size=3, padding=1, groups=4, out_channels=4),  # depthwise
        dict(kernel_size=2, padding=3),  # padding wider than the kernel
        dict(kernel_size=3, padding=(0, 1, 2)),  # asymmetric over dims
    ]
    for mode in ("reflect", "replicate", "circular"):
        cfgs.append(dict(kernel_size=3, padding=1, padding_mode=mode))
        cfgs.append(dict(kernel_size=3, padding=(1, 2, 1), stride=2, padding_mode=mode))
        cfgs.append(dict(kernel_size=4, padding="same", padding_mode=mode))
    return cfgs


def _make(cfg: dict, seed: int) -> nn.Conv3d:
    cfg = dict(cfg)
    torch.manual_seed(seed)
    return nn.Conv3d(4, cfg.pop("out_channels", 3), **cfg).double()


def _size_along(conv: nn.Conv3d, i: int, world: int) -> int:
    """A length of spatial dim ``i`` every rank can run; not divisible by ``world`` > 1."""
    k, s, d = conv.kernel_size[i], conv.stride[i], conv.dilation[i]
    pads = conv._reversed_padding_repeated_twice[2 * (2 - i) : 2 * (2 - i) + 2]
    n = world * s * (d * (k - 1) + max(pads) + 3)
    return n + 1 if world > 1 else n


def conv3d_grid(world: int) -> list[str]:
    """Each configuration sharded along one of D, H, W (rotating with the world size, so the
    1-4 rank tests together cover every configuration along every dim at >1 rank)."""
    dmesh = mesh(world)
    failures: list[str] = []
    for j, cfg in enumerate(_conv3d_configs()):
        conv = _make(cfg, seed=j)
        for dim in (VOLUME_DIMS[(j + world) % 3],):
            # small but padding-safe sizes (reflect needs size > pad) on the local dims
            shape = [max(5, conv.kernel_size[i] * conv.dilation[i] + 1) for i in range(3)]
            shape[dim - 2] = _size_along(conv, dim - 2, world)
            x = seeded(100 * j + dim, 2 if dim == 2 else 1, 4, *shape, dtype=torch.float64)
            label = f"{cfg} Shard({dim}) {tuple(x.shape)}"
            check_module(conv, x, dmesh, [Shard(dim)], label, failures)
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_conv3d_grid_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, conv3d_grid, world)[0]
    assert not failures, "\n".join(failures)


def functional_conv3d(world: int) -> list[str]:
    """``F.conv3d`` called from model code is routed to the sharded convolution too."""
    w = seeded(5, 3, 4, 3, 2, 3, dtype=torch.float64)
    failures: list[str] = []
    for dim in VOLUME_DIMS:
        shape = [5, 6, 7]
        shape[dim - 2] = 4 * world + 1
        x = seeded(6 + dim, 1, 4, *shape, dtype=torch.float64)

        def fn(t):
            return nn.functional.conv3d(t, w, None, 1, "same", 2)

        check_fn(fn, x, mesh(world), [Shard(dim)], f"F.conv3d Shard({dim})", failures)
    return failures


def test_functional_conv3d(dist_pool):
    assert not dist_pool.run(3, functional_conv3d, 3)[0]


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
