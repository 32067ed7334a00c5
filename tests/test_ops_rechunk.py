"""Re-chunk edge cases the reshaping grid (``test_reshape_grid.py``) leaves out, on width
strips: zero and cropping ``F.pad`` amounts, padding the channels, an integer index on the
channels; exact in fp64 against the plain op, forward and input gradient, with
point-to-point traffic only (no gather). And the plans' traffic: flip talks to the mirrored
owner only, a strided slice receives one hull per owner."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from spconv_train.parallel._rechunk import Segment, plan_remap
from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import seeded

CASES = {
    "pad crop+pad": lambda x: F.pad(x, (-2, 3, 1, -1)),
    "pad zero replicate": lambda x: F.pad(x, [0, 0, 0, 0], "replicate"),
    "pad circular crop": lambda x: F.pad(x, (-2, 3, 0, 0), "circular"),
    "pad channels": lambda x: F.pad(x, (1, 1, 0, 0, 1, 2)),
    "channel int": lambda x: x[:, 1],
}


def rechunk_checks(world: int, width: int) -> list[str]:
    failures: list[str] = []
    x = seeded(2, 2, 3, 5, width, dtype=torch.float64)
    for label, fn in CASES.items():
        check_fn(fn, x, mesh(world), [Shard(3)], f"{label} @{world} w={width}", failures)
    return failures


def test_rechunk_edge_cases_exact_without_gather(dist_pool):
    for failures in dist_pool.run(3, rechunk_checks, 3, 11):
        assert not failures, failures


def test_flip_plan_talks_to_mirrored_owner_only():
    # width 12 over 4 ranks: rank r's flipped columns all live on rank 3 - r (one message)
    plan = plan_remap(12, 4, (Segment(11, 12, -1),))
    for r in range(4):
        assert [owner for owner, _, _ in plan.exchange.pieces(r)] == [3 - r]
    # x[..., ::2]: each rank receives one hull per owner, never the whole width
    plan = plan_remap(12, 4, (Segment(0, 6, 2),))
    assert all(sum(e - s for s, e in plan.exchange.needed[r]) <= 4 for r in range(4))
