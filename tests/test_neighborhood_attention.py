"""Neighbourhood (local) attention written by a user, sharded (issue 23, docs/attention.md).

Every pixel attends to the ``k x k`` (``k x k x k``) pixels around it, neighbours outside
the image masked with ``-inf``: the block of docs/attention.md (``F.unfold`` on the keys
and values, a mask unfolded from a plain map of ones, ``masked_fill``), read from the page
and run, and the ``F.pad`` + ``Tensor.unfold`` form for images and volumes (mask applied
with ``torch.where``). fp64 against one device, output and every parameter gradient, halo
traffic and no activation gather (``op_check.check_model_audited``), on uneven W strips at
2 and 3 ranks, 2 x 2 tiles, rows, a map split along H over one mesh dim, and a volume
split along W.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import device, mesh
from tests.op_check import check_model_audited
from tests.reference import seeded

DOC = Path(__file__).resolve().parents[1] / "docs" / "attention.md"
MARK = "<!-- tests/test_neighborhood_attention.py runs this block -->"
DIM, HEADS = 8, 2


def doc_block() -> type[nn.Module]:
    """``NeighborhoodAttention`` as docs/attention.md defines it."""
    (block,) = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", DOC.read_text(), re.S)
    ns: dict = {"torch": torch, "nn": nn, "F": F}
    exec(compile(block, str(DOC), "exec"), ns)  # noqa: S102 - the project's own docs
    return ns["NeighborhoodAttention"]


def neighbours(t: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, C, *S) -> (B, C, *S, k ** n)``: each position's ``k``-wide neighbourhood in
    every spatial dim, zero padded (``F.pad``, then ``Tensor.unfold`` per dim)."""
    n = t.ndim - 2
    t = F.pad(t, [k // 2] * 2 * n)
    for d in range(2, 2 + n):
        t = t.unfold(d, k, 1)
    return t.flatten(-n)


class NeighborhoodAttentionNd(nn.Module):
    """The same attention with ``F.pad`` + ``Tensor.unfold``, for images and volumes."""

    def __init__(self, dim: int, heads: int, k: int, spatial: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if spatial == 2 else nn.Conv3d
        self.qkv, self.proj, self.heads, self.k = conv(dim, 3 * dim, 1), conv(dim, dim, 1), heads, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, *S = x.shape
        h, d = self.heads, C // self.heads
        q, k, v = self.qkv(x).chunk(3, 1)
        k, v = (neighbours(t, self.k).view(B, h, d, *S, -1) for t in (k, v))
        s = (q.view(B, h, d, *S, 1) * k).sum(2) * d**-0.5  # (B, h, *S, k ** n)
        inside = neighbours(torch.ones(1, 1, *S, dtype=x.dtype, device=x.device), self.k)
        a = torch.where(inside > 0, s, float("-inf")).softmax(-1)
        return self.proj((a.unsqueeze(2) * v).sum(-1).reshape(B, C, *S))


def brute_force(model: nn.Module, x: torch.Tensor, k: int, dilation: int) -> torch.Tensor:
    """Neighbourhood attention of a 2-D ``model``'s projections, pixel by pixel."""
    B, C, H, W = x.shape
    h, d = model.heads, C // model.heads
    q, kk, v = (t.view(B, h, d, H, W) for t in model.qkv(x).chunk(3, 1))
    out = torch.zeros(B, h, d, H, W, dtype=x.dtype)
    r = k // 2 * dilation
    for i in range(H):
        for j in range(W):
            nb = [
                (a, b)
                for a in range(i - r, i + r + 1, dilation)
                for b in range(j - r, j + r + 1, dilation)
                if 0 <= a < H and 0 <= b < W
            ]
            keys = torch.stack([kk[..., a, b] for a, b in nb], -1)  # (B, h, d, n)
            vals = torch.stack([v[..., a, b] for a, b in nb], -1)
            w = ((q[..., i, j].unsqueeze(-1) * keys).sum(2) * d**-0.5).softmax(-1)
            out[..., i, j] = (w.unsqueeze(2) * vals).sum(-1)
    return model.proj(out.reshape(B, C, H, W))


@pytest.mark.parametrize("k, dilation", [(3, 1), (5, 2)])
def test_both_forms_are_neighbourhood_attention_on_one_device(k, dilation):
    torch.manual_seed(0)
    model = doc_block()(DIM, HEADS, k, dilation).double()
    x = seeded(1, 2, DIM, 5, 6, dtype=torch.float64)
    want = brute_force(model, x, k, dilation)
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)
    if dilation == 1:
        nd = NeighborhoodAttentionNd(DIM, HEADS, k).double()
        nd.load_state_dict(model.state_dict())
        torch.testing.assert_close(nd(x), want, rtol=1e-12, atol=1e-12)


def im2col(width: int) -> nn.Module:
    """A 1x1 conv, then ``nn.Unfold`` (kernel 3, padding 1, stride 2) of a ``5 x width``
    map, its tokens viewed back as the output map."""
    grid = (3, (width - 1) // 2 + 1)
    return nn.Sequential(
        nn.Conv2d(DIM, 2, 1), nn.Unfold(3, padding=1, stride=2), nn.Unflatten(2, grid)
    )


def _cases(world: int) -> list[tuple]:
    """``(label, model, input shape, mesh shape, mesh names, placements)`` per case."""
    na = doc_block()
    n = 3 * world + 1  # uneven over ``world`` ranks
    strips = ((world,), ("sp",), [Shard(3)])
    if world == 4:
        tiles = ((2, 2), ("sp_h", "sp_w"), [Shard(2), Shard(3)])
        return [
            ("tiles F.unfold k3", na(DIM, HEADS, 3), (1, DIM, 5, 7), *tiles),
            ("tiles F.unfold k5", na(DIM, HEADS, 5), (1, DIM, 5, 7), *tiles),
            ("tiles Tensor.unfold k3", NeighborhoodAttentionNd(DIM, HEADS, 3), (1, DIM, 5, 7),
             *tiles),
        ]  # fmt: skip
    cases = [
        ("strips F.unfold k3", na(DIM, HEADS, 3), (2, DIM, 5, n), *strips),
        ("strips F.unfold k5", na(DIM, HEADS, 5), (1, DIM, 4, n), *strips),
        ("strips Tensor.unfold k5", NeighborhoodAttentionNd(DIM, HEADS, 5), (1, DIM, 4, n),
         *strips),
    ]  # fmt: skip
    if world == 2:
        rows = ((2, 1), ("sp_h", "sp_w"), [Shard(2), Shard(3)])
        cases += [
            ("strips F.unfold k3 dilation 2", na(DIM, HEADS, 3, 2), (1, DIM, 4, n), *strips),
            ("rows F.unfold k3", na(DIM, HEADS, 3), (1, DIM, n, 4), *rows),
            ("H on one mesh dim F.unfold k3", na(DIM, HEADS, 3), (1, DIM, n, 4), (2,), ("sp",),
             [Shard(2)]),
            ("strips nn.Unfold stride 2", im2col(n), (1, DIM, 5, n), *strips),
            ("volume W Tensor.unfold k3", NeighborhoodAttentionNd(DIM, HEADS, 3, spatial=3),
             (1, DIM, 3, 4, n), (2,), ("sp",), [Shard(4)]),
        ]  # fmt: skip
    return cases


def run_cases(world: int) -> list[str]:
    failures: list[str] = []
    for label, model, shape, mshape, names, placements in _cases(world):
        model = model.double().to(device())
        for p in model.parameters():
            p.data = seeded(3, *p.shape, dtype=torch.float64).to(device())
        x = seeded(1, *shape, dtype=torch.float64).to(device())
        failures += check_model_audited(
            model,
            x,
            lambda s: seeded(2, *s, dtype=torch.float64).to(device()),
            mesh(mshape, names),
            placements,
            traffic="halo",
            same_placements=True,
            label=f"{label} {shape} on {mshape}: ",
        )
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_neighbourhood_attention_matches_one_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, run_cases, world)):
        assert not failures, f"rank {rank}: " + "\n".join(failures[:10])
