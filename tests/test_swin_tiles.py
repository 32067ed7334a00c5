"""Swin window attention on H x W tiles and rows, and MONAI SwinUNETR in 3-D split along H
and along D (issue 23): the window partition of a map split along several dims (or along a
dim that is not the innermost window index) re-chunks each split dim to window-aligned
owners in turn, the batch of windows is a nested token layout (tiles) or a strided one
(even chunks of the merged window indices), and the reverse puts every split back. fp64
against one device: output, every parameter gradient, re-chunk traffic point to point and
no activation gather.

One worker call per world size: 2 x 2 tiles (4 ranks) run the hand-written Swin of
``tests/test_swin.py`` (regular and shifted windows, SDPA and explicit matmuls, patch
merging, NCHW windows, one window over the whole map) and a timm ``SwinTransformer`` (the
model smp's ``tu-swin`` encoders build); rows (a ``(2, 1)`` mesh) run the hand-written Swin
and SwinUNETR 3-D along H and along D."""

from __future__ import annotations

import pytest
import torch

from tests.meshes import mesh_and_placements
from tests.op_check import check_model_audited
from tests.reference import seeded
from tests.test_swin import TinySwin

pytest.importorskip("timm")

NAMES = ("sp_h", "sp_w")


def _tiny_swin(shape: tuple[int, int]) -> list[str]:
    """8 x 20 pixels: 2 windows of 4 along H (rows 4 + 4), 5 along W (columns 10 + 10,
    windows 3 + 2); the last stage 2 x 5 is one window (every rank's part on the first)."""
    dmesh, placements = mesh_and_placements(shape, NAMES)
    torch.manual_seed(0)
    return check_model_audited(
        TinySwin().double(),
        seeded(1, 2, 3, 8, 20, dtype=torch.float64),
        seeded(2, 2, 2, 2, 5, dtype=torch.float64),
        dmesh,
        placements,
        param_shapes={(1, 2, 16, 16), (1, 2, 10, 10)},  # the relative position bias
        traffic="re-chunk",
        label=f"mesh {shape} TinySwin: ",
    )


def tile_failures() -> list[str]:
    """2 x 2 tiles: the hand-written Swin, and timm's Swin at 24 x 24 (12 x 12 tokens: 3
    windows of 4 along H and W, rows and columns 6 + 6, windows 2 + 1; merged to 6 x 6,
    padded to 8 x 8: 2 x 2 windows)."""
    from tests.test_swin_models import model_failures

    out = _tiny_swin((2, 2))
    return out + [
        f"timm 24 x 24 on 2 x 2 tiles: {f}" for f in model_failures("timm", 24, 24, (2, 2))
    ]


def row_failures() -> list[str]:
    """Rows (``(2, 1)`` mesh), and SwinUNETR 3-D split along H (32 x 64 x 32) and along D
    (64 x 32 x 32) at 2 ranks: every stage's windows re-chunked along the split dim, the
    last stage (4 x 2 x 2, or 2 x 4 x 2) one window on the first rank."""
    pytest.importorskip("monai")
    from tests.test_monai_3d import volume_failures

    out = _tiny_swin((2, 1))
    out += volume_failures("SwinUNETR", (32, 64, 32), 3)
    return out + volume_failures("SwinUNETR", (64, 32, 32), 2)


@pytest.mark.parametrize("world, worker", [(4, tile_failures), (2, row_failures)])
def test_swin_on_tiles_rows_and_volumes_matches_one_device(dist_pool, world, worker):
    for rank, failures in enumerate(dist_pool.run(world, worker)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])
