"""``AdaptiveMaxPool2d`` / ``F.adaptive_max_pool2d`` on H x W tiles (issue 12 item 1):
values and gradients against one device in fp64 on 2 x 2, (1, 3) and (3, 1) meshes, sizes
that do not split evenly, windows that straddle tiles, and inputs full of ties (the
gradient goes to the first maximum in row-major order, as on one device). The output is
``Replicate`` on the tile mesh (small outputs only, as the adaptive average), and so are
the indices of ``return_indices=True`` (global flat indices, compared with torch's);
outputs larger than a quarter of a tile are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.meshes import each_mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded

#: world -> [(mesh shape, mesh dim names)]
MESHES = {
    3: [((1, 3), ("sp_h", "sp_w")), ((3, 1), ("sp_h", "sp_w"))],
    4: [((2, 2), ("sp_h", "sp_w")), ((2, 1, 2), ("dp", "sp_h", "sp_w"))],
}


class _ChannelAttention(nn.Module):
    """CBAM's channel attention: a shared 1x1-conv MLP on the global average and the global
    max, their sigmoid broadcast onto the tiles."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Conv2d(4, 2, 1), nn.ReLU(), nn.Conv2d(2, 4, 1))
        self.max = nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        a = self.mlp(F.adaptive_avg_pool2d(x, 1)) + self.mlp(self.max(x))
        return x * torch.sigmoid(a)


def _inputs(i: int, *size: int) -> dict[str, torch.Tensor]:
    """Random values, integers in [-2, 2] (ties inside and across tiles) and a constant
    image (every element of every window ties)."""
    x = seeded(60 + i, 2, 4, *size, dtype=torch.float64)
    return {"random": x, "ties": (x * 1.5).round().clamp(-2, 2), "constant": torch.ones_like(x)}


def adaptive_max_on_tiles(world: int) -> list[str]:
    failures: list[str] = []
    for dmesh, pl, shape in each_mesh(MESHES[world]):
        # 3 ranks: 17 x 19 (6, 6, 5 rows or 7, 6, 6 columns); 2 x 2: 11 x 13 (6, 5 x 7, 6)
        h, w = (17, 19) if world == 3 else (11, 13)
        # global, 2 x 2 and 1 x 3 outputs (windows straddle the tiles); ties: quantized
        # values everywhere, and a constant image for one size
        for i, size in enumerate([1, (2, 2), (1, 3)]):
            inputs = list(_inputs(i, h, w).items())[: 3 if i == 1 else 2]
            if len(pl) == 3:  # ties do not depend on the batch split: random only on dp
                inputs = inputs[:1]
            for kind, x in inputs:
                label = f"{shape} adaptive_max_pool2d({size}) {kind} {h}x{w}"
                # values and (compared too) the global flat indices of the maxima
                fn = lambda t, size=size: F.adaptive_max_pool2d(t, size, True)  # noqa: E731
                check_fn(fn, x, dmesh, pl, label, failures)
        x = seeded(70, 2, 4, h, w, dtype=torch.float64)
        torch.manual_seed(0)
        cbam = _ChannelAttention().double()
        check_module(cbam, x, dmesh, pl, f"{shape} CBAM channel attention", failures)
        with SpatialMode():
            y = F.adaptive_max_pool2d(distribute_tensor(x, dmesh, pl), 2)
        want = [Shard(0), Replicate(), Replicate()] if len(pl) == 3 else [Replicate()] * 2
        if list(y.placements) != want:
            failures.append(f"{shape}: output placements {y.placements}, expected {want}")
    return failures


@pytest.mark.parametrize("world", [3, 4])
def test_adaptive_max_pool2d_on_tiles_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, adaptive_max_on_tiles, world)[0]
    assert not failures, "\n".join(failures)


def adaptive_max_3d_on_volume_tiles() -> list[str]:
    """The same op on NCDHW volumes split over (sp_d, sp_w) and (sp_d, sp_h, sp_w), 7 x 9 x 11
    (D 4 + 3, H 5 + 4, W 6 + 5): ties go to the first maximum in (D, H, W) order."""
    failures: list[str] = []
    specs = [((2, 2), ("sp_d", "sp_w")), ((1, 2, 2), ("sp_d", "sp_h", "sp_w"))]
    for dmesh, pl, names in each_mesh(specs, ndim=5):
        for i, size in enumerate([1, (2, 2, 2), (1, 3, 2)]):
            for kind, x in list(_inputs(i, 7, 9, 11).items())[: 3 if i == 1 else 2]:
                label = f"{names} adaptive_max_pool3d({size}) {kind}"
                fn = lambda t, size=size: F.adaptive_max_pool3d(t, size)  # noqa: E731
                check_fn(fn, x, dmesh, pl, label, failures)
        x = seeded(71, 2, 4, 7, 9, 11, dtype=torch.float64)
        check_module(nn.AdaptiveMaxPool3d(2), x, dmesh, pl, f"{names} module", failures)
    return failures


def test_adaptive_max_pool3d_on_volume_tiles_matches_single_device(dist_pool):
    failures = dist_pool.run(4, adaptive_max_3d_on_volume_tiles)[0]
    assert not failures, "\n".join(failures)


def refusals() -> list[str]:
    dmesh = mesh((2, 2), ("sp_h", "sp_w"))
    xs = distribute_tensor(
        seeded(5, 1, 4, 11, 13, dtype=torch.float64), dmesh, [Shard(2), Shard(3)]
    )
    cases = {
        "F.adaptive_max_pool2d": (lambda t: F.adaptive_max_pool2d(t, (3, 3)), "quarter of a tile"),
        "AdaptiveMaxPool2d": (nn.AdaptiveMaxPool2d((4, 2)), "quarter of a tile"),
    }
    failures = []
    for name, (fn, words) in cases.items():
        try:
            if isinstance(fn, nn.Module):
                from spconv_train.parallel import parallelize

                parallelize(nn.Sequential(fn), dmesh)(xs)
            else:
                with SpatialMode():
                    fn(xs)
            failures.append(f"{name}: ran on tiles")
        except SpatialShardingError as e:
            if name.strip() not in str(e) or words not in str(e) or "tiles" not in str(e):
                failures.append(f"{name}: unclear refusal: {e}")
    return failures


def test_adaptive_max_pool2d_refusals_on_tiles(dist_pool):
    failures = dist_pool.run(4, refusals)[0]
    assert not failures, "\n".join(failures)
