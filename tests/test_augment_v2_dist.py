"""``data.augment`` at 2 and 3 gloo ranks: every rank draws the plan alone and loads only its
strip or tile; stitched, the parts equal the whole crop augmented in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spconv_train.data.augment_spec import parse_augment
from spconv_train.data.augment_v2 import draw_plan, load_plan_part
from spconv_train.data.grid import stitch_grid
from spconv_train.data.strips import strip_bounds
from tests.augment_sources import random_source

ITEMS = [
    {"name": "rot90", "p": 0.7},
    {"name": "transpose", "p": 0.5},
    {
        "name": "affine",
        "p": 0.9,
        "degrees": 25,
        "translate": [0.1, 0.1],
        "scale": [0.8, 1.2],
        "shear": 8,
    },  # fmt: skip
    {"name": "elastic", "p": 0.9, "alpha": 3.0, "sigma": 5.0},
    {"name": "brightness", "p": 0.8, "factor": 0.2},
    {"name": "contrast", "p": 0.8, "factor": 0.2},
    {"name": "gamma", "p": 0.8},
    {"name": "noise", "p": 0.8, "sigma": 0.02},
]
CROP = (17, 23)  # odd sizes: uneven strips and tiles at 2 and 3 ranks
CASES = [(index, epoch) for index in range(3) for epoch in range(3)]


def _plan(index: int, epoch: int):
    return draw_plan(
        11, epoch, index, image_hw=(40, 52), crop_hw=CROP, specs=parse_augment(ITEMS),
        hflip=0.5, vflip=0.5, scale=(0.8, 1.25),
    )  # fmt: skip


def _rank_parts(grid: tuple[int, int]) -> list:
    """This rank's part of every case on a ``grid`` (rows x columns of ranks), and how
    many crop pixels it read (to show no rank reads a whole image)."""
    rank, (p, q) = dist.get_rank(), grid
    source = random_source(3)
    out = []
    for index, epoch in CASES:
        plan = _plan(index, epoch)
        rows, cols = strip_bounds(CROP[0], p, rank // q), strip_bounds(CROP[1], q, rank % q)
        source.reads.clear()
        image, mask = load_plan_part(source, index, plan, cols, rows=rows, ignore_index=255)
        read = sum((r1 - r0) * (c1 - c0) for _, (r0, r1), (c0, c1) in source.reads)
        out.append((image, mask, read, plan.out_hw))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_augment_equals_whole_crop(dist_pool, world):
    source = random_source(3)
    for grid in [(1, world), (world, 1)]:  # strips, then row tiles
        per_rank = dist_pool.run(world, _rank_parts, grid)
        for k, (index, epoch) in enumerate(CASES):
            plan = _plan(index, epoch)
            assert all(parts[k][3] == plan.out_hw == CROP for parts in per_rank)
            image, mask = load_plan_part(source, index, plan, (0, CROP[1]), ignore_index=255)
            got_mask = stitch_grid([parts[k][1] for parts in per_rank], grid, (0, 1))
            got_image = stitch_grid([parts[k][0] for parts in per_rank], grid, (1, 2))
            assert torch.equal(got_mask, mask), (grid, index, epoch)
            torch.testing.assert_close(got_image, image, atol=1e-6, rtol=0)
            # A rank reads at most the crop's source region (<= 484 pixels measured), never
            # the 40 x 52 image.
            assert all(parts[k][2] <= 40 * 52 // 3 for parts in per_rank)
