"""Token pooling: a sum or mean over the split token dim of pixel tokens (a ViT's average
pool, ``x[:, p:].mean(1)`` behind prefix tokens) is local sums added over every mesh dim
that splits the tokens (``_token_reduce._token_wise``), not DTensor's own rule, which
redistributes the tokens to every rank (a refusal inside the forward). fp64 output and
every parameter gradient against one device, uneven token counts, strips and tiles, with
and without prefix tokens, no activation-sized collective (``tests/op_check.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_model_audited
from tests.reference import seeded

#: per world: a tile mesh (one of its dims of size 1)
TILES = {2: (1, 2), 3: (3, 1)}


class TokenPool(nn.Module):
    """Pixel tokens of a map (``prefix`` learned tokens in front), pooled over the pixel
    tokens by mean and by sum (keepdim, a dtype), a linear head, and the map scaled by it
    per channel (a squeeze-excitation through tokens)."""

    def __init__(self, prefix: int, c: int = 6) -> None:
        super().__init__()
        self.p = prefix
        self.proj = nn.Conv2d(3, c, 3, padding=1)
        self.cls = nn.Parameter(torch.randn(1, prefix, c)) if prefix else None
        self.head = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        t = y.flatten(2).transpose(1, 2)
        if self.p:
            t = torch.cat([self.cls.expand(x.shape[0], -1, -1), t], 1)
        pixels = t[:, self.p :] if self.p else t
        pooled = pixels.mean(1) + 0.1 * torch.sum(pixels.square(), 1, True, dtype=t.dtype)[:, 0]
        pooled = pooled + pixels.mean((1, 2), keepdim=True)[:, 0] - 0.01 * pixels.sum(1)
        scale = self.head(pooled + t[:, 0] if self.p else pooled)
        return y * scale.view(*scale.shape, 1, 1)


def pool_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    h, w = 5, 3 * world + 1  # uneven
    x = seeded(41, 2, 3, h, w, dtype=torch.float64)
    tiles = mesh(TILES[world], ("sp_h", "sp_w"))
    for label, dmesh, placements in (
        ("strips", mesh(world), [Shard(3)]),
        ("tiles", tiles, [Shard(2), Shard(3)]),
    ):
        for prefix in (0, 2):
            torch.manual_seed(0)
            failures += check_model_audited(
                TokenPool(prefix).double(), x, lambda s: seeded(42, *s, dtype=torch.float64),
                dmesh, placements, label=f"{label} prefix {prefix}: ", traffic=None,
                gather_numel=32,
            )  # fmt: skip
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_token_pooling_matches_single_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, pool_failures)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])
