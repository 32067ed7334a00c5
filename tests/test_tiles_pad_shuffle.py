"""A sub-pixel upsampler (conv, ``PixelShuffle``, ``ReflectionPad2d``, conv) on H x W tiles
against one device in fp64: output, input and every parameter gradient, no activation-sized
collective, on a 2 x 2 mesh with uneven sizes. (Each op alone, on every layout:
``test_reshape_grid.py``.)"""

from __future__ import annotations

import torch
from torch import nn

from tests.meshes import mesh_and_placements
from tests.op_check import check_module
from tests.reference import seeded


def sub_pixel_block() -> list[str]:
    failures: list[str] = []
    dmesh, pl = mesh_and_placements((2, 2), ("sp_h", "sp_w"))
    torch.manual_seed(3)
    block = nn.Sequential(
        nn.Conv2d(3, 12, 3, padding=1),
        nn.PixelShuffle(2),
        nn.ReflectionPad2d(1),
        nn.Conv2d(3, 2, 3),
    ).double()
    x = seeded(713, 2, 3, 9, 11, dtype=torch.float64)
    check_module(block, x, dmesh, pl, "sub-pixel block", failures)
    return failures


def test_sub_pixel_block_on_tiles_matches_single_device(dist_pool):
    for rank, failures in enumerate(dist_pool.run(4, sub_pixel_block)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
