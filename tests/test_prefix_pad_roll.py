"""``F.pad``, ``roll``, ``flip``, ``chunk`` and ``split`` of tokens behind prefix (class /
register) tokens: along the channels exact (the prefix kept where it is; likewise ``t.mT`` /
``t.mH``), along the tokens refused by name on every rank alike (DTensor's rules ran them on
a layout without the prefix: silently wrong after, a gradient of the wrong shape, or ranks
in different collectives). fp64 output, input and every gradient against one device,
no-gather audit, W strips, H strips and tiles."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spconv_train.parallel.extend import SpatialShardingError
from tests.op_check import check_fn
from tests.reference import seeded
from tests.test_review_tok2 import _meshes, _no_failures, _with_prefix

#: along the channels (dim -1): the prefix stays where it is
CHANNELS = [
    ("F.pad channels", lambda t, n: F.pad(t, (1, 2), value=0.5)[:, 2:][:, :, 1:-2] * 2),
    ("F.pad channels reflect", lambda t, n: F.pad(t, (2, 1), "reflect")[:, 2:][:, :, :-3]),
    ("roll channels", lambda t, n: t.roll(1, -1)[:, 2:]),
    ("torch.roll dims=", lambda t, n: torch.roll(t, shifts=2, dims=2)[:, 2:]),
    ("flip channels", lambda t, n: t.flip(-1)[:, 2:] * 2),
    ("torch.flip dims=", lambda t, n: torch.flip(t, dims=(2,))[:, 2:]),
    ("torch.flip input= dims=", lambda t, n: torch.flip(input=t, dims=[-1])[:, 2:].sin()),
    ("chunk channels", lambda t, n: t.chunk(2, -1)[1][:, 2:].repeat(1, 1, 2)),
    ("torch.chunk dim=", lambda t, n: torch.chunk(t, 3, dim=2)[0][:, 2:].repeat(1, 1, 2)),
    ("split channels", lambda t, n: t.split([3, 1], -1)[0][:, 2:].sin().repeat(1, 1, 2)[..., 1:5]),
    ("torch.split dim=", lambda t, n: torch.split(t, 2, dim=-1)[1][:, 2:].repeat(1, 1, 2)),
]
#: the matrix-transpose properties: the transpose they are (the prefix moves with its dim)
TRANSPOSED = [
    ("mT", lambda t, n: (t.mT * 2).mT[:, 2:]),
    ("mH", lambda t, n: (t.mH - 1).transpose(1, 2)[:, 2:]),
    ("mT of pixel tokens", lambda t, n: t[:, 2:].mT.mT.sin()),
]
#: along the tokens (dim 1) or every dim: refused
TOKENS = [
    ("F.pad tokens", lambda t, n: F.pad(t, (0, 0, 1, 0))[:, 3:]),
    ("roll tokens", lambda t, n: t.roll(1, 1)[:, 2:]),
    ("roll flattened", lambda t, n: t.roll(1)[:, 2:]),
    ("flip tokens", lambda t, n: t.flip(1)[:, 2:]),
    ("chunk tokens", lambda t, n: torch.cat(t.chunk(2, 1), 1)[:, 2:]),
    ("split tokens", lambda t, n: torch.cat(torch.split(t, 3, dim=-2), 1)[:, 2:]),
]


def pad_roll_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(45, 2, 4, 2 * world + 2, 3 * world + 1, dtype=torch.float64)
    for label, dmesh, placements in _meshes(world):
        for name, op in CHANNELS + TRANSPOSED:
            try:
                check_fn(_with_prefix(op), x, dmesh, placements, f"{name} {label}", failures)
            except Exception as e:  # noqa: BLE001
                failures.append(f"{name} {label}: {type(e).__name__}: {str(e)[:300]}")
        for name, op in TOKENS:
            try:
                check_fn(_with_prefix(op), x, dmesh, placements, f"{name} {label}", [])
                failures.append(f"{name} {label}: not refused")
            except SpatialShardingError as e:
                if "prefix" not in str(e):
                    failures.append(f"{name} {label}: refused without naming the prefix: {e}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_pad_and_roll_behind_prefix(dist_pool, world):
    _no_failures(dist_pool.run(world, pad_roll_failures))
