"""MONAI's SwinUNETR in 2-D (Swin window attention, patch merging, shifted windows, a conv
decoder with instance norm) sharded along W at 2 and 3 ranks equals one device in fp64:
output and every parameter gradient, with no activation-sized collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_module
from tests.reference import seeded

TOL = 1e-10


def swinunetr_failures(h: int, w: int) -> list[str]:
    from monai.networks.nets import SwinUNETR

    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)  # the same random weights on every rank (the reference's too)
    model = SwinUNETR(
        in_channels=3,
        out_channels=2,
        feature_size=12,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 1, 1),
        window_size=4,
        spatial_dims=2,
        norm_name="instance",
    ).double()
    x = seeded(1, 1, 3, h, w, dtype=torch.float64)
    failures: list[str] = []
    check_module(model, x, dmesh, [Shard(3)], f"SwinUNETR {h}x{w}", failures, TOL)
    return failures


@pytest.mark.parametrize("world, width", [(2, 96), (3, 160)])
def test_swinunetr_2d_matches_single_device(dist_pool, world, width):
    pytest.importorskip("einops")
    pytest.importorskip("monai")
    # W / 32 = 3 and 5 columns at the deepest stage: 2 + 1 and 2 + 2 + 1, uneven
    for rank, failures in enumerate(dist_pool.run(world, swinunetr_failures, 32, width)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
