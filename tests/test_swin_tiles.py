"""Swin windows on H x W tiles and on rows (issue 23)."""

from __future__ import annotations

import pytest
import torch

from tests.meshes import mesh_and_placements
from tests.op_check import check_model_audited
from tests.reference import seeded
from tests.test_swin import TinySwin

NAMES = ("sp_h", "sp_w")


def tiny_swin_failures(shape: tuple[int, int]) -> list[str]:
    dmesh, placements = mesh_and_placements(shape, NAMES)
    torch.manual_seed(0)
    model = TinySwin().double()
    x = seeded(1, 2, 3, 8, 20, dtype=torch.float64)
    gy = seeded(2, 2, 2, 2, 5, dtype=torch.float64)
    return check_model_audited(
        model,
        x,
        gy,
        dmesh,
        placements,
        param_shapes={(1, 2, 16, 16), (1, 2, 10, 10)},
        traffic="re-chunk",
        label=f"mesh {shape} TinySwin: ",
    )


@pytest.mark.parametrize("world, shape", [(4, (2, 2)), (2, (2, 1))])
def test_tiny_swin_on_tiles(dist_pool, world, shape):
    for rank, failures in enumerate(dist_pool.run(world, tiny_swin_failures, shape)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


from tests.test_swin_models import model_failures  # noqa: E402
from tests.test_monai_3d import volume_failures  # noqa: E402
