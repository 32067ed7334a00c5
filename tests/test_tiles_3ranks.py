"""3-rank tile meshes (issue 12 item 1): an image split over (sp_h, sp_w) = (3, 1) and
(1, 3), and over (dp, sp_h, sp_w) = (1, 3, 1), with sizes that do not split evenly over 3:
pools, BatchNorm, resizing, transposed conv, adaptive pools and the small U-Net (Conv2d:
tests/test_conv_grid.py) against one device in fp64 (forward, input and every parameter gradient, no
activation-sized collective). A 6-rank (2 x 3) mesh is not run: the harness keeps one
worker group per world size and CI has 2 cores (4 ranks at most elsewhere in the suite)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.meshes import mesh_and_placements
from tests.op_check import check_module
from tests.reference import seeded
from tests.test_tiles import model_tiles

#: label -> (mesh shape, mesh dim names)
MESHES = {
    "(3, 1)": ((3, 1), ("sp_h", "sp_w")),
    "(1, 3)": ((1, 3), ("sp_h", "sp_w")),
    "dp (1, 3, 1)": ((1, 3, 1), ("dp", "sp_h", "sp_w")),
}


def _ops() -> list[tuple[str, nn.Module]]:
    """Ops whose halos fit the smallest tile of a 17 x 19 image over 3 (6, 6, 5 rows;
    7, 6, 6 columns)."""
    ops: list[tuple[str, nn.Module]] = [
        ("MaxPool2d(2)", nn.MaxPool2d(2)),
        ("MaxPool2d(3, 2, 1, ceil)", nn.MaxPool2d(3, 2, 1, ceil_mode=True)),
        ("AvgPool2d(3, 2, 1, no pad)", nn.AvgPool2d(3, 2, 1, count_include_pad=False)),
        ("BatchNorm2d", nn.BatchNorm2d(4)),
        ("GroupNorm", nn.GroupNorm(2, 4)),
        ("ConvTranspose2d(3, 2, 1, 1)", nn.ConvTranspose2d(4, 3, 3, 2, 1, output_padding=1)),
        ("Upsample bilinear x2", nn.Upsample(scale_factor=2, mode="bilinear")),
        ("Upsample nearest to 23x29", nn.Upsample(size=(23, 29), mode="nearest")),
        (
            "Upsample bilinear 0.5 align",
            nn.Upsample(scale_factor=0.5, mode="bilinear", align_corners=True),
        ),
        ("AdaptiveAvgPool2d(1)", nn.AdaptiveAvgPool2d(1)),
        ("AdaptiveMaxPool2d((2, 2))", nn.AdaptiveMaxPool2d((2, 2))),
    ]
    return ops


def ops_on_3_tiles(key: str) -> list[str]:
    shape, names = MESHES[key]
    dmesh, pl = mesh_and_placements(shape, names)
    failures: list[str] = []
    ops = _ops() if key != "dp (1, 3, 1)" else _ops()[::2]  # suite time: alternate ops
    for i, (name, module) in enumerate(ops):
        torch.manual_seed(i)
        x = seeded(500 + i, 2, 4, 17, 19, dtype=torch.float64)
        check_module(module.double(), x, dmesh, pl, f"{key} {name}", failures)
    return failures


@pytest.mark.parametrize("key", list(MESHES))
def test_ops_on_3_rank_tiles_match_single_device(dist_pool, key):
    failures = dist_pool.run(3, ops_on_3_tiles, key)[0]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "shape,up,hw",
    [
        ((3, 1), "transpose", (20, 21)),  # H 20 = (7, 7, 6), pooled 10 = (4, 4, 2)
        ((1, 3), "bilinear", (18, 23)),  # W 23 = (8, 8, 7), pooled 11: resize to the skip
    ],  # on a dp mesh: tests/test_tiles.py (dp 2 x 1 x 2)
    ids=["3x1", "1x3"],
)
def test_unet_on_3_rank_tiles_matches_single_device(dist_pool, shape, up, hw):
    kwargs = dict(depth=2, base_width=4, up=up)
    for rank, failures in enumerate(dist_pool.run(3, model_tiles, "unet", shape, kwargs, hw)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
