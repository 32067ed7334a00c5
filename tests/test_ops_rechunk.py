"""Padding (every F.pad mode and module, negative and zero amounts), slicing of the width,
flip and roll on a width-sharded DTensor: exact in fp64 against the plain op, forward and
input gradient, with point-to-point traffic only (no gather)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from spconv_train.parallel._rechunk import cols, plan_remap
from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import seeded

CASES = {
    "pad constant": lambda x: F.pad(x, (2, 3), value=0.5),
    "pad crop+pad": lambda x: F.pad(x, (-2, 3, 1, -1)),
    "pad zero replicate": lambda x: F.pad(x, [0, 0, 0, 0], "replicate"),
    "pad reflect": lambda x: F.pad(x, (3, 2, 1, 2), "reflect"),
    "pad replicate": lambda x: F.pad(x, (4, 1, 0, 1), "replicate"),
    "pad circular": lambda x: F.pad(x, (3, 2, 1, 1), "circular"),
    "pad circular crop": lambda x: F.pad(x, (-2, 3, 0, 0), "circular"),
    "pad channels": lambda x: F.pad(x, (1, 1, 0, 0, 1, 2)),
    "ZeroPad2d": nn.ZeroPad2d((0, 1, 0, 1)),
    "ConstantPad2d": nn.ConstantPad2d(2, -1.5),
    "ReflectionPad2d": nn.ReflectionPad2d(2),
    "ReplicationPad2d": nn.ReplicationPad2d((1, 3, 2, 0)),
    "CircularPad2d": nn.CircularPad2d(1),
    "slice a:b": lambda x: x[..., 2:9],
    "slice ::2": lambda x: x[..., ::2],
    "slice 1::3 rows": lambda x: x[:, :, 1:4, 1::3],
    "centre crop": lambda x: x[:, :, 1:-1, 2:-3],
    "channel int": lambda x: x[:, 1],
    "flip w": lambda x: torch.flip(x, [-1]),
    "flip hw method": lambda x: x.flip((2, 3)),
    "roll w": lambda x: torch.roll(x, 3, -1),
    "roll hw": lambda x: x.roll((1, -4), (2, 3)),
}


def rechunk_checks(world: int, width: int, names: tuple[str, ...]) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    x = seeded(2, 2, 3, 5, width, dtype=torch.float64)
    for label in names:
        check_fn(CASES[label], x, dmesh, [Shard(3)], f"{label} @{world} w={width}", failures)
    return failures


def dp_checks() -> list[str]:
    failures: list[str] = []
    x = seeded(3, 2, 3, 4, 11, dtype=torch.float64)
    for label in ("pad reflect", "slice ::2", "flip w", "roll w"):
        check_fn(CASES[label], x, mesh((2, 2)), [Shard(0), Shard(3)], f"dp {label}", failures)
    return failures


def test_pad_slice_flip_roll_exact_without_gather(dist_pool):
    # every case at 3 ranks (uneven strips); at 4 ranks with a 1-column strip (13 = 4+4+4+1:
    # thinner than the reflect/replicate pads, so owners beyond the neighbour send) the
    # cases that move columns far; a few at 1 and 2 ranks and on a (dp, sp) mesh
    few = ("pad reflect", "pad circular", "slice ::2", "flip w", "roll w")
    thin = ("pad reflect", "pad replicate", "pad circular", "ReflectionPad2d", "slice ::2")
    thin += ("centre crop", "flip w", "roll w")
    runs = ((3, 11, tuple(CASES)), (4, 13, thin), (1, 9, few), (2, 9, few))
    for world, width, names in runs:
        for failures in dist_pool.run(world, rechunk_checks, world, width, names):
            assert not failures, failures
    for failures in dist_pool.run(4, dp_checks):
        assert not failures, failures


def test_flip_plan_talks_to_mirrored_owner_only():
    # width 12 over 4 ranks: rank r's flipped columns all live on rank 3 - r (one message)
    plan = plan_remap(12, 4, (cols(11, 12, -1),))
    for r in range(4):
        assert [owner for owner, _, _ in plan.exchange.pieces(r)] == [3 - r]
    # x[..., ::2]: each rank receives one hull per owner, never the whole width
    plan = plan_remap(12, 4, (cols(0, 6, 2),))
    assert all(sum(e - s for s, e in plan.exchange.needed[r]) <= 4 for r in range(4))
