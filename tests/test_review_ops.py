"""Cases the shorter conv / window / resize / norm / re-chunk code must keep exact, that the
op grids do not reach: ``align_corners=True`` resized to one output column (the ratio of
a single column), the linear modes' default ``align_corners=None`` on strips and on a
replicated volume (the plain-op fall-back), ``roll`` along one sharded dim twice (shifts
summed, also to 0) next to an unsharded dim, and group norm's refusal order when both the
group count and the weight are wrong (torch's divisibility error first). fp64 against one
device, uneven widths, no-gather audit (``tests/op_check.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn
from tests.reference import seeded

#: per world: a tile mesh (one of its dims of size 1 at 2 ranks)
TILES = {2: (1, 2), 3: (3, 1)}


def _resize_cases(world: int) -> list:
    """``(label, fn, input, placements)``: resizes on W strips and replicated volumes."""
    w = 3 * world + 1  # uneven
    image = seeded(21, 2, 3, 5, w, dtype=torch.float64)
    vol = seeded(22, 1, 2, 3, 4, w, dtype=torch.float64)
    up = dict(mode="bilinear", align_corners=True)
    return [
        ("bilinear align size (1, 1)", lambda t: F.interpolate(t, size=(1, 1), **up), image),
        ("bilinear align size (1, W+3)", lambda t: F.interpolate(t, size=(1, w + 3), **up), image),
        ("bilinear align size (4, 1)", lambda t: F.interpolate(t, size=(4, 1), **up), image),
        ("bilinear default x2", lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), image),
        (
            "bilinear default size",
            lambda t: F.interpolate(t, size=(7, 2 * w - 1), mode="bilinear"),
            image,
        ),
        ("trilinear default x2", lambda t: F.interpolate(t, scale_factor=2, mode="trilinear"), vol),
    ]


def resize_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    dmesh = mesh(world)
    for (
        label,
        fn,
        x,
    ) in _resize_cases(world):
        check_fn(fn, x, dmesh, [Shard(x.ndim - 1)], f"{label} Shard(-1)", failures)
        # a replicated input on a strip mesh: an image goes to strips, a volume stays whole
        check_fn(fn, x, dmesh, [Replicate()], f"{label} Replicate", failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_resize_edge_cases_match_single_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, resize_failures)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


def roll_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(23, 2, 3, 2 * world + 1, 3 * world + 2, dtype=torch.float64)
    rolls = {
        "W twice, C": ((2, -3, 1, 4), (3, 1, 3, -1)),
        "W to 0, H": ((5, -5, 2), (-1, 3, 2)),
        "H, W, H": ((1, 3, 4), (2, 3, 2)),
    }
    tiles = mesh_and_placements(TILES[world], ("sp_h", "sp_w"))
    for dmesh, pl, layout in ((mesh(world), [Shard(3)], "strips"), (*tiles, "tiles")):
        for label, (shifts, dims) in rolls.items():
            fn = lambda t, s=shifts, d=dims: torch.roll(t, s, d)  # noqa: E731
            check_fn(fn, x, dmesh, pl, f"roll {label} on {layout}", failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_roll_summed_shifts_match_single_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, roll_failures)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


def group_norm_errors() -> list[tuple[str, str]]:
    """(type, message) of F.group_norm with 6 channels in 4 groups and a 5-channel weight:
    on one device, then on W strips."""
    x = seeded(24, 2, 6, 3, 5, dtype=torch.float64)
    xs = distribute_tensor(x, mesh(dist.get_world_size()), [Shard(3)])
    w = torch.ones(5, dtype=torch.float64)
    found = []
    for t, ctx in ((x, None), (xs, SpatialMode)):
        try:
            if ctx is None:
                F.group_norm(t, 4, w)
            else:
                with ctx():
                    F.group_norm(t, 4, w)
        except (RuntimeError, ValueError) as e:
            found.append((type(e).__name__, str(e)))
    return found


def test_group_norm_refuses_in_torch_order(dist_pool):
    for (plain_type, plain), (kind, msg) in dist_pool.run(2, group_norm_errors):
        assert kind == plain_type == "RuntimeError", (kind, msg)
        assert plain.split(" but ")[0] in msg, (plain, msg)
