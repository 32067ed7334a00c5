"""A ViT's prefix (class / register) tokens in front of pixel tokens split over H x W tiles
and rows (issue 23), and token-wise reductions over the channels of prefixed tokens
(``F.normalize``, ``x / x.norm(...)``, ``mean`` / ``var`` / ``amax`` / ``logsumexp`` over
dim -1: ``_token_reduce.py``) on strips and tiles. fp64 output and every parameter gradient
equal one device, with no activation gather."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_model_audited
from tests.reference import seeded

pytest.importorskip("timm")

NAMES = ("sp_h", "sp_w")


def _channel_ops(t: torch.Tensor) -> torch.Tensor:
    """Token-wise reductions over the channels that DTensor's own backward sizes wrongly
    behind a prefix."""
    t = F.normalize(t, dim=-1) + t / t.norm(dim=-1, keepdim=True)
    t = t - t.mean(-1, keepdim=True) + t.var(-1, keepdim=True) * t.amax(-1, keepdim=True)
    return t + t.logsumexp(-1, keepdim=True) + torch.max(t, -1).values.unsqueeze(-1)


def _normalize_case(label: str, dmesh, placements) -> list[str]:
    from tests.test_vit_class_token import PrefixOp

    torch.manual_seed(0)
    x = seeded(1, 2, 3, 5, 7, dtype=torch.float64)  # uneven: 3 + 2 rows, 4 + 3 columns
    return check_model_audited(
        PrefixOp(_channel_ops).double(), x, lambda s: seeded(2, *s, dtype=torch.float64),
        dmesh, list(placements), traffic=None, label=f"{label} channel ops: ",
    )  # fmt: skip


def prefix_tile_failures(shape: tuple[int, ...]) -> list[str]:
    """Every case on the mesh ``shape``: ``(2,)`` strips, ``(2, 1)`` rows, ``(2, 2)`` tiles."""
    if len(shape) == 1:
        dmesh, placements = mesh(dist.get_world_size()), [Shard(3)]
    else:
        dmesh, placements = mesh_and_placements(shape, NAMES)
    failures = _normalize_case(f"mesh {shape}", dmesh, placements)
    return failures


@pytest.mark.parametrize("world, shape", [(2, (2,))])
def test_prefix_tokens_on_tiles_match_one_device(dist_pool, world, shape):
    for rank, failures in enumerate(dist_pool.run(world, prefix_tile_failures, shape)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:10])
