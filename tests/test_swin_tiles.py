"""Swin window attention on H x W tiles and rows, and MONAI's 3-D Swin stage split along D
and along H (issue 23): the window partition of a map split along several dims (or along a
dim that is not the innermost window index) re-chunks each split dim to window-aligned
owners in turn, the batch of windows is a nested token layout (tiles) or a strided one
(even chunks of the merged window indices), and the reverse puts every split back. fp64
against one device: output, every parameter gradient, re-chunk traffic point to point and
no activation gather.

One worker call per world size: 2 x 2 tiles (4 ranks) run the hand-written Swin of
``tests/test_swin.py`` (regular and shifted windows, SDPA and explicit matmuls, patch
merging, NCHW windows, one window over the whole map) and a timm ``SwinTransformer`` (the
model smp's ``tu-swin`` encoders build), and on the ``(dp, sp)`` mesh (batch over ``dp``)
timm's Swin on strips and the MONAI stage below along D; 2 ranks run both on rows (a
``(2, 1)`` mesh) and a MONAI SwinUNETR stage (``BasicLayer``: regular and shifted 3-D
windows on the channels-last volume, padding to whole windows, ``PatchMergingV2``) split
along D and along H. The whole SwinUNETR in 3-D (its last stage one window):
``scripts/check_foreign_models.py --transformers``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
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
    """2 x 2 tiles: the hand-written Swin, and timm's Swin at 16 x 24 (8 x 12 tokens: 2
    windows of 4 along H, rows 4 + 4; 3 along W, columns 6 + 6, windows 2 + 1; merged to
    4 x 6, padded to 4 x 8: one window row, on the first rank of ``sp_h``)."""
    from tests.test_swin_models import model_failures

    timm = model_failures("timm", 16, 24, (2, 2))
    out = _tiny_swin((2, 2)) + [f"timm 16 x 24 on 2 x 2 tiles: {f}" for f in timm]
    pytest.importorskip("monai")
    return out + _timm_dp_strips() + _monai_stage(2, (10, 4, 4), dp=2)


def _monai_stage(dim: int, shape: tuple[int, int, int], dp: int = 1) -> list[str]:
    """MONAI's ``BasicLayer`` (2 blocks, windows of 4^3, shift 2, ``PatchMergingV2``) on a
    ``(dp, 8, *shape)`` volume split along tensor dim ``dim`` over 2 ranks (and its batch
    over ``dp`` ranks when ``dp > 1``): the split dim of 10 (5 + 5) padded to 12, 3
    windows (2 + 1)."""
    from monai.networks.nets import swin_unetr

    torch.manual_seed(0)
    model = swin_unetr.BasicLayer(
        8, 2, 2, (4, 4, 4), [0.0, 0.0], downsample=swin_unetr.PatchMergingV2
    ).double()
    dmesh, placements = (
        (mesh((dp, 2), ("dp", "sp")), [Shard(0), Shard(dim)]) if dp > 1 else (mesh(2), [Shard(dim)])
    )
    return check_model_audited(
        model,
        seeded(1, dp, 8, *shape, dtype=torch.float64),
        lambda out: seeded(2, *out, dtype=torch.float64),
        dmesh,
        placements,
        param_shapes={(1, 2, 64, 64)},  # the relative position bias
        traffic="re-chunk",
        label=f"SwinUNETR stage {shape} Shard({dim}) dp {dp}: ",
    )


class _Nchw(torch.nn.Module):
    """timm's channels-last output ``(B, H, W, C)`` as ``(B, C, H, W)``: split like the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 3, 1, 2)


def _timm_dp_strips() -> list[str]:
    """timm's Swin at 16 x 24 (W: 6 + 6 tokens, windows 2 + 1) on the ``(dp, sp)`` mesh
    that ``spconv-train run`` builds with ``parallel.dp = 2``: a batch of 2 split over
    ``dp``, W over ``sp``."""
    from tests.test_swin_models import BUILDERS

    torch.manual_seed(0)
    model = torch.nn.Sequential(BUILDERS["timm"](16, 24), _Nchw()).double()
    bias = {
        (1, m.relative_position_bias_table.shape[1], *m.relative_position_index.shape)
        for m in model.modules()
        if hasattr(m, "relative_position_index")
    }
    return check_model_audited(
        model,
        seeded(1, 2, 3, 16, 24, dtype=torch.float64),
        lambda out: seeded(2, *out, dtype=torch.float64),
        mesh((2, 2), ("dp", "sp")),
        [Shard(0), Shard(3)],
        param_shapes=bias,
        traffic="re-chunk",
        label="timm 16 x 24 on (dp, sp) strips: ",
    )


def two_rank_failures() -> list[str]:
    """Rows (``(2, 1)`` mesh: the hand-written Swin; timm's at 24 x 16, whose second stage
    6 x 4 pads W, the dim of one rank, to 8), and the 3-D stage split along D and H."""
    from tests.test_swin_models import model_failures

    pytest.importorskip("monai")
    timm = [f"timm 24 x 16 on rows: {f}" for f in model_failures("timm", 24, 16, (2, 1))]
    out = _tiny_swin((2, 1)) + timm
    return out + _monai_stage(2, (10, 8, 8)) + _monai_stage(3, (8, 10, 8))


@pytest.mark.parametrize("world, worker", [(4, tile_failures), (2, two_rank_failures)])
def test_swin_on_tiles_rows_and_volumes_matches_one_device(dist_pool, world, worker):
    for rank, failures in enumerate(dist_pool.run(world, worker)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])
