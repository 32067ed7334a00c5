"""One tie-break rule for max pooling on every layout: torch's (the first maximum in
row-major order). Integer-valued fp64 inputs full of exact ties, with maxima planted on both
sides of every shard boundary and a later rank holding the row-major first maximum, on width
strips, H x W tiles, volumes sharded along D, H or W, and volume tiles, at 2 and 3 ranks:
values, global indices (``return_indices``; images) and the input gradient (which shows the
element each tie went to) equal one device's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn
from tests.reference import seeded

STRIP_OPS = {
    "max_pool2d 3/1/1": lambda t: F.max_pool2d(t, 3, 1, 1, return_indices=True),
    "adaptive_max_pool2d 1": lambda t: F.adaptive_max_pool2d(t, 1, True),
    "adaptive_max_pool2d (2, 3)": lambda t: F.adaptive_max_pool2d(t, (2, 3), True),
}
#: tiles hold small adaptive outputs only (a quarter of a tile at most)
TILE_OPS = {
    "max_pool2d 2/2 ceil": lambda t: F.max_pool2d(t, 2, 2, 0, 1, True, True),
    "adaptive_max_pool2d (1, 2)": lambda t: F.adaptive_max_pool2d(t, (1, 2), True),
}
#: volumes refuse return_indices: the gradient shows where each tie went
VOLUME_OPS = {
    "max_pool3d 3/1/1": lambda t: F.max_pool3d(t, 3, 1, 1),
    "adaptive_max_pool3d 1": lambda t: F.adaptive_max_pool3d(t, 1),
    "adaptive_max_pool3d 2": lambda t: F.adaptive_max_pool3d(t, 2),
}
VOLUME_TILE_OPS = {
    "max_pool3d 2/2 ceil": lambda t: F.max_pool3d(t, 2, 2, 0, 1, True),
    "adaptive_max_pool3d (1, 1, 2)": lambda t: F.adaptive_max_pool3d(t, (1, 1, 2)),
}


def _tied(seed: int, shape: tuple[int, ...], dims: tuple[int, ...], parts: tuple[int, ...]):
    """Values in {-1, 0, 1}; the maximum 3 planted on both sides of every shard boundary
    of the sharded ``dims`` and at the start of the last shard (first row, so that a later
    rank holds the row-major first maximum while rank 0 holds one in a later row)."""
    x = (seeded(seed, *shape, dtype=torch.float64) * 1.2).round().clamp(-1, 1)
    for d, n in zip(dims, parts, strict=True):
        size = shape[d]
        for r in range(1, n):
            b = -(-size // n) * r  # DTensor's chunk boundary
            if 0 < b < size:
                x.narrow(d, b - 1, 2).fill_(3.0)
    last, n = dims[-1], parts[-1]
    first = [0] * (len(shape) - 2)
    first[last - 2] = min(-(-shape[last] // n) * (n - 1), shape[last] - 1)  # last shard
    later = [0] * (len(shape) - 2)
    later[1 if last == 2 else 0] = 1  # a later row, on rank 0
    x[(..., *first)] = x[(..., *later)] = 9.0
    return x


def _check(ops: dict, x, dmesh, pl, label: str, failures: list[str]) -> None:
    for name, fn in ops.items():
        check_fn(fn, x, dmesh, pl, f"{label} {name}", failures)


def ties_on_every_layout(world: int) -> list[str]:
    failures: list[str] = []
    x = _tied(1, (2, 2, 5, 4 * world + 1), (3,), (world,))
    _check(STRIP_OPS, x, mesh(world), [Shard(3)], "strips", failures)
    shape = (1, world) if world == 2 else (world, 1)  # H x W tiles
    dmesh, pl = mesh_and_placements(shape, ("sp_h", "sp_w"))
    x = _tied(2, (1, 2, 3 * world + 4, 3 * world + 5), (2, 3), shape)
    _check(TILE_OPS, x, dmesh, pl, f"tiles {shape}", failures)
    for d in (3, 4):  # volumes sharded along H or W (D first: the lowest rank is first)
        size = [4, 5, 6]
        size[d - 2] = 3 * world + 1
        x = _tied(3 + d, (1, 2, *size), (d,), (world,))
        _check(VOLUME_OPS, x, mesh(world), [Shard(d)], f"Shard({d})", failures)
    dmesh, pl = mesh_and_placements((1, world), ("sp_d", "sp_w"), ndim=5)  # volume tiles
    x = _tied(9, (1, 2, 4, 5, 3 * world + 2), (2, 4), (1, world))
    _check(VOLUME_TILE_OPS, x, dmesh, pl, "volume tiles", failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_max_pool_ties_match_single_device_on_every_layout(dist_pool, world):
    failures = dist_pool.run(world, ties_on_every_layout, world)[0]
    assert not failures, "\n".join(failures)
