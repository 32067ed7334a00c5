"""Per-pixel ops over channels on a width-sharded DTensor: channels-last LayerNorm and Linear
(permute -> op -> permute back), PReLU, layer scale by a reshaped parameter, chunk/split/cat
along channels (plain tensors among them too), pixel_shuffle/unshuffle. Exact in fp64
against one device: output, input gradient and every parameter gradient; no gather."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_module
from tests.reference import seeded


class ChannelsLast(nn.Module):
    """timm LayerNorm2d + ConvNeXt MLP on channels-last, layer scale, PReLU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.act = nn.PReLU(8)
        self.act1 = nn.PReLU()

    def forward(self, x):
        y = self.conv(x).permute(0, 2, 3, 1)
        y = self.fc(F.layer_norm(y, (8,), self.norm.weight, self.norm.bias)).permute(0, 3, 1, 2)
        y = y.mul(self.gamma.reshape(1, -1, 1, 1)) + 0.5 * y
        return self.act1(self.act(y) - y / self.gamma.reshape(1, -1, 1, 1))


class Splits(nn.Module):
    """chunk / split / cat along channels, a plain tensor in the cat, pixel (un)shuffle."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.up = nn.PixelShuffle(2)
        self.down = nn.PixelUnshuffle(2)

    def forward(self, x):
        y = self.conv(x)
        a, b = torch.chunk(y, 2, dim=1)
        c, d, e = y.split([2, 2, 4], 1)
        empty = torch.zeros(
            y.shape[0], 0, *y.shape[2:], dtype=y.dtype, device=y.device
        )  # timm's dummy
        z = torch.cat([a * b, c, empty, d + e[:, :2]], dim=1)  # 8 channels
        u = self.up(z)  # 2 channels, 2x the width
        return self.down(u * u) + z


def channel_checks(world: int, width: int) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    torch.manual_seed(0)
    x = seeded(3, 2, 3, 4, width, dtype=torch.float64)
    for label, model in (("channels-last", ChannelsLast()), ("splits", Splits())):
        check_module(model.double(), x, dmesh, [Shard(3)], f"{label} @{world}", failures)
    return failures


def test_channel_ops_exact_without_gather(dist_pool):
    for world, width in ((2, 9), (3, 11)):
        for failures in dist_pool.run(world, channel_checks, world, width):
            assert not failures, failures
