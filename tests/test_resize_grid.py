"""``F.interpolate`` / ``nn.Upsample`` against one device: one grid.

Images (``nn.Upsample``: scales 2, 3, 1.5, 0.5 and per-dim, size targets with non-integer
ratios; nearest, nearest-exact, bilinear with and without ``align_corners``, with and
without ``recompute_scale_factor``) on width strips, a share of them on the world's H x W
tiles; volumes (``F.interpolate``: nearest, nearest-exact, trilinear, sizes and scales) sharded
along D, H and W, a share of them on volume blocks at 4 ranks; world sizes 1 to 4 with sizes
that do not split evenly. Output and input gradient (images under the world's upstream
gradient placement: ``Shard``, ``Replicate`` or ``Partial``), volumes and tiles in fp64
with the no-gather audit (``tests/op_check.py``). All cases of a world size run in one
worker call.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn, check_module
from tests.reference import compare_module, seeded

GRAD_KINDS = {1: "shard", 2: "replicate", 3: "shard", 4: "partial"}
#: per world: the H x W tile mesh and the volume block mesh a share of the cases runs on
TILES = {2: (1, 2), 3: (3, 1), 4: (2, 2)}
BLOCKS = {4: ((2, 2), ("sp_d", "sp_w"))}


def image_configs(world: int) -> list[tuple[dict, tuple[int, int]]]:
    """(nn.Upsample kwargs, input (H, W)): scales 2, 3, 1.5, 0.5 and size targets with
    non-integer ratios, every mode / align_corners / recompute_scale_factor."""
    w = 5 * world + 2
    modes = [("nearest", None), ("nearest-exact", None), ("bilinear", False), ("bilinear", True)]
    cfgs = []
    for (mode, ac), rc in itertools.product(modes, (None, True)):
        for sf in (2, 3, 1.5, 0.5, (1.5, 2.5)):
            cfgs.append((dict(scale_factor=sf, recompute_scale_factor=rc), (5, w)))
        if rc is None:
            for size, hw in (((9, 40), (5, 17)), ((4, 9), (6, 23)), ((5, 2 * w + 1), (5, w))):
                cfgs.append((dict(size=size), hw))
        for c, _ in cfgs[-8:]:
            c.update(mode=mode, align_corners=ac)
    return cfgs


def volume_cases() -> dict:
    tri = dict(mode="trilinear")
    return {
        "nearest x2": dict(scale_factor=2),
        "nearest size": dict(size=(5, 7, 3)),
        "nearest (1.5, 0.7, 2.3)": dict(scale_factor=(1.5, 0.7, 2.3)),
        "nearest-exact size": dict(size=(6, 4, 9), mode="nearest-exact"),
        "trilinear x2": dict(scale_factor=2, **tri),
        "trilinear x2 align": dict(scale_factor=2, align_corners=True, **tri),
        "trilinear size": dict(size=(7, 3, 11), **tri),
        "trilinear size align": dict(size=(7, 3, 11), align_corners=True, **tri),
        "trilinear 0.6 recompute": dict(scale_factor=0.6, recompute_scale_factor=True, **tri),
    }


def volume(seed: int, world: int, dim: int, base=(4, 5, 6), extra: int = 1) -> torch.Tensor:
    """A small fp64 volume whose sharded ``dim`` is uneven over ``world`` ranks."""
    shape = list(base)
    shape[dim - 2] = 3 * world + extra
    return seeded(seed, 1, 2, *shape, dtype=torch.float64)


def resize_grid(world: int) -> list[str]:
    dmesh, failures = mesh(world), []
    for i, (cfg, (h, w)) in enumerate(image_configs(world)):
        x = seeded(3000 + i, 2, 3, h, w)
        label = f"Upsample({cfg}) {h}x{w}"
        kind = GRAD_KINDS[world]
        compare_module(nn.Upsample(**cfg), x, dmesh, [Shard(3)], kind, label, failures)
        if world > 1 and i % 8 == world:  # on tiles: fp64, audited
            tmesh, pl = mesh_and_placements(TILES[world], ("sp_h", "sp_w"))
            xt = seeded(4000 + i, 1, 2, 3 * h + 1, w, dtype=torch.float64)
            label = f"tiles {TILES[world]} {label.replace(f'{h}x', f'{3 * h + 1}x')}"
            check_module(nn.Upsample(**cfg), xt, tmesh, pl, label, failures)
    for j, (label, kw) in enumerate(volume_cases().items()):
        fn = lambda t, kw=kw: F.interpolate(t, **kw)  # noqa: E731
        for dim in (2, 3, 4):
            x = volume(j, world, dim, extra=1 + (j + dim) % 2)
            tag = f"interpolate {label} Shard({dim}) {tuple(x.shape)}"
            check_fn(fn, x, dmesh, [Shard(dim)], tag, failures)
        if world in BLOCKS and j % 2 == 0:
            bmesh, pl = mesh_and_placements(*BLOCKS[world], ndim=5)
            x = seeded(90 + j, 1, 2, 7, 5, 9, dtype=torch.float64)
            check_fn(fn, x, bmesh, pl, f"interpolate {label} blocks DW {tuple(x.shape)}", failures)
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resize_grid_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, resize_grid, world)[0]
    assert not failures, "\n".join(failures)


def test_grid_covers_every_mode():
    cfgs = [c for c, _ in image_configs(3)]
    assert {c.get("scale_factor") for c in cfgs} >= {2, 3, 1.5, 0.5}
    assert {(c["mode"], c["align_corners"]) for c in cfgs} == {
        ("nearest", None), ("nearest-exact", None), ("bilinear", False), ("bilinear", True)
    }  # fmt: skip
    assert {c.get("recompute_scale_factor") for c in cfgs} == {None, True}
    assert sum("size" in c for c in cfgs) == 12
    modes = {kw.get("mode", "nearest") for kw in volume_cases().values()}
    assert modes == {"nearest", "nearest-exact", "trilinear"}
