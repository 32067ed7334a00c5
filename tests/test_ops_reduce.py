"""Reductions and statistics (sum, mean, amax, amin, var, std; functions and Tensor methods)
and softmax / log_softmax / cumsum over H, W, C or all dims of a width-sharded DTensor:
exact in fp64, no activation gather."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import seeded

CASES = {
    "mean hw keepdim": lambda x: x.mean((2, 3), keepdim=True),
    "torch.mean w": lambda x: torch.mean(x, -1),
    "sum all": lambda x: x.sum(),
    "sum c keep": lambda x: x.sum(1, keepdim=True),
    "sum h": lambda x: torch.sum(x, dim=2),
    "mean n,w list": lambda x: x.mean([0, 3]),
    "amax hw": lambda x: x.amax((2, 3)),
    "amin w keep": lambda x: torch.amin(x, -1, keepdim=True),
    "amax all": lambda x: x.amax(),
    "var hw": lambda x: x.var((2, 3), keepdim=True),
    "std hw": lambda x: x.std((2, 3)),
    "std correction0": lambda x: torch.std(x, (-2, -1), correction=0, keepdim=True),
    "var unbiased false": lambda x: x.var(False),
    "var w biased": lambda x: x.var(3, False, True),
    "se block": lambda x: x * torch.sigmoid(x.mean((2, 3), keepdim=True)),
    "softmax w": lambda x: torch.softmax(x, -1),
    "log_softmax w": lambda x: F.log_softmax(x, dim=3),
    "softmax c method": lambda x: x.softmax(1),
    "cumsum w": lambda x: torch.cumsum(x, 3),
    "cumsum h method": lambda x: x.cumsum(-2),
}


def reduce_checks(shape: tuple[int, ...], width: int, names: tuple[str, ...]) -> list[str]:
    dmesh = mesh(shape)
    placements = [Shard(3)] if len(shape) == 1 else [Shard(0), Shard(3)]
    failures: list[str] = []
    x = seeded(1, 2, 3, 5, width, dtype=torch.float64)
    x[0, 0, 1, 2] = x.max() + 1.0  # a unique maximum and a tie across strips for amax
    x[1, 1, 2, 0] = x[1, 1, 2, width - 1] = x.max() + 2.0
    for label in names:
        check_fn(CASES[label], x, dmesh, placements, f"{label} @{shape} w={width}", failures)
    # a width-replicated input (after global pooling) stays exact and local
    rep = [Replicate()] * len(shape)
    check_fn(CASES["std hw"], x, dmesh, rep, f"replicated @{shape}", failures)
    return failures


def test_reductions_exact_without_gather(dist_pool):
    # every case at 3 ranks (uneven strips), a few at 1, 2 and on a (dp, sp) mesh
    few = ("mean hw keepdim", "amax all", "std hw", "se block", "softmax w", "cumsum w")
    runs = ((3, (3,), 10, tuple(CASES)), (1, (1,), 7, few), (2, (2,), 9, few), (4, (2, 2), 11, few))
    for world, shape, width, names in runs:
        for failures in dist_pool.run(world, reduce_checks, shape, width, names):
            assert not failures, failures
