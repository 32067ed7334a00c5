"""The reshaping ops on every layout: slicing and centre crops, ``flip``, ``roll``, ``F.pad``
(every mode, cropping), ``pixel_shuffle`` / ``pixel_unshuffle``, reductions (sum, mean,
amax, amin, var, std) and scans (softmax, log_softmax, cumsum) along every sharded axis of
width strips, H x W tiles, volumes sharded along D, H or W, and volume blocks (two mesh
dims), at 2, 3 and 4 ranks with uneven sizes. Each case against one device in fp64:
output, input gradient, and no activation-sized collective (``check_fn``). One worker call
per world size runs that world's whole grid."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn
from tests.reference import seeded


def _index(*spatial) -> tuple:
    return (slice(None), slice(None), *spatial)


def _cumsums(t, dims):
    out = t.cumsum(dims[0])
    for d in dims[1:]:
        out = out + t.cumsum(d)
    return out


def _even(t):
    """``t`` cropped to even H and W (what ``pixel_unshuffle`` by 2 takes)."""
    return t[..., : t.shape[-2] // 2 * 2, : t.shape[-1] // 2 * 2]


def _ops(rank: int) -> dict:
    """The grid's ops for a tensor of ``rank`` spatial dims (NCHW: 2, NCDHW: 3), chained a
    few per case (one value and gradient check covers each op of the chain); each touches
    every spatial dim, so every sharded axis of every layout."""
    dims = tuple(range(2, 2 + rank))
    crop = _index(*(slice(1, -1), slice(2, None), slice(None, -2))[:rank])
    strided = _index(*(slice(1, None, 2), slice(None, None, 3), slice(0, -1, 2))[:rank])
    pads = (1, 2, 2, 1, 0, 3)[: 2 * rank]
    cropping, edges = (-1, 2, 1, -2, 1, 0)[: 2 * rank], (3, 0, 0, 2, 1, 1)[: 2 * rank]
    shifts = (3, -2, 5)[:rank]
    return {
        "centre crop, flip, roll": lambda t: torch.roll(torch.flip(t[crop], dims), shifts, dims),
        "strided slice, flip last, roll twice, int C": (
            lambda t: t[strided].flip(-1).roll((1, 2), (-1, -1))[:, 1, 1:]
        ),
        "pad constant (cropping), reflect": (
            lambda t: F.pad(F.pad(t, cropping, value=0.5), pads, "reflect")
        ),
        "pad replicate, circular": lambda t: F.pad(F.pad(t, edges, "replicate"), pads, "circular"),
        "mean, var, amax, amin, std (keepdim)": lambda t: (
            t * torch.sigmoid(t.mean(dims, keepdim=True))
            + t.var(dims, keepdim=True) * t.amax(dims, keepdim=True)
            + torch.amin(t, -1, keepdim=True) * torch.std(t, 2, correction=0, keepdim=True)
        ),
        "sum, amax, std": lambda t: (
            torch.sum(t, (0, -1)),
            t.amax(dims),
            torch.std(t, 2, correction=0),
        ),
        "softmax, log_softmax, cumsum": lambda t: (
            torch.softmax(t, 2) * F.log_softmax(t, dim=-1) + _cumsums(t, dims)
        ),
    }


#: on the last two dims (the dims before them act as a batch): layouts whose sharded dims
#: are among those (a volume's D is the shuffle's channels, so D must stay whole)
SHUFFLES = {
    "pixel_unshuffle": lambda t: F.pixel_unshuffle(_even(t), 2),
    "pixel_shuffle, unshuffle": lambda t: F.pixel_unshuffle(F.pixel_shuffle(t, 2) * t.amax(), 2),
}


#: the cases 4 ranks (2 x 2 tiles) skip: their ops run in the other cases too
WORLD4_SKIPS = ("strided slice, flip last, roll twice, int C", "sum, amax, std", "pixel_unshuffle")


def _input(seed: int, shape: list[int], sharded: dict[int, int]) -> torch.Tensor:
    """Random fp64 values with exact ties across every shard boundary (for amax / amin):
    the two elements either side of the first boundary of each sharded dim."""
    x = seeded(seed, *shape, dtype=torch.float64)
    top = x.abs().max().item() + 1.0
    for d, parts in sharded.items():
        b = -(-shape[d] // parts)  # DTensor's first chunk boundary
        for i in (b - 1, b) if 0 < b < shape[d] else ():
            x[tuple(i if k == d else 0 for k in range(len(shape)))] = top
    return x


def _statistics(shape: list[int], dmesh, placements) -> frozenset:
    """The shapes a reduction or scan along a sharded dim sums over its mesh dim: one plane
    of per-position statistics (softmax, var) of this rank's block, or a table of one per
    rank (cumsum). A volume's plane across D is an H x W map, which the audit would take for
    an activation."""
    local = list(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            chunk = -(-shape[p.dim] // dmesh.size(m))
            start = min(chunk * dmesh.get_local_rank(m), shape[p.dim])
            local[p.dim] = min(chunk, shape[p.dim] - start)
    out = set()
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            plane = (*local[: p.dim], 1, *local[p.dim + 1 :])
            out |= {plane, (dmesh.size(m), *plane)}
    return frozenset(out)


def _layouts(world: int) -> list:
    """``(label, mesh, placements, input shape)`` of the grid's layouts at ``world`` ranks,
    sharded sizes uneven (a 1-element chunk at 3 ranks)."""
    n = 7  # 3 + 3 + 1 at 3 ranks
    tiles = {2: (2, 1), 3: (3, 1), 4: (2, 2)}[world]
    blocks = {2: ((2, 1), ("sp_d", "sp_w")), 3: ((1, 3), ("sp_h", "sp_w"))}
    out = [("tiles", *mesh_and_placements(tiles, ("sp_h", "sp_w")), [2, 4, 2 * world + 5, 10])]
    if world == 3:  # strips: the 1-element chunk (other strip cases: test_ops_rechunk.py)
        out.append(("strips", mesh(world), [Shard(3)], [2, 4, 5, n]))
    for d in {2: (2, 4), 3: (3,), 4: ()}[world]:  # a volume along D, H or W
        size = [4, 5, 6]
        size[d - 2] = n
        out.append((f"volume Shard({d})", mesh(world), [Shard(d)], [1, 2, *size]))
    if world in blocks:  # volume blocks (4 ranks on 2 cores: the 2 x 2 tiles only)
        shape, names = blocks[world]
        dmesh, pl = mesh_and_placements(shape, names, ndim=5)
        size = [5 if shape[0] > 1 else 4, 4 + world, 2 * world + 5]
        out.append((f"blocks {shape} {names}", dmesh, pl, [1, 2, *size]))
    if world == 2:  # spatially replicated (after a global pool): every op local
        out.append(("replicated", mesh(2), [Replicate()], [2, 4, 5, 6]))
    return out


def _shuffles_fit(shape: list[int], sharded: dict[int, int]) -> bool:
    """Whether ``SHUFFLES`` run on this layout: a volume's D (the shuffle's channels) whole
    and a multiple of 4, and the unshuffled H and W leave every rank a non-empty chunk."""
    if len(shape) == 5 and (2 in sharded or shape[2] % 4):
        return False
    chunks = [(shape[d] // 2, p) for d, p in sharded.items() if d >= len(shape) - 2]
    return all(-(-m // p) * (p - 1) < m for m, p in chunks)


def reshape_grid(world: int) -> list[str]:
    failures: list[str] = []
    for i, (label, dmesh, pl, shape) in enumerate(_layouts(world)):
        sharded = {p.dim: dmesh.size(m) for m, p in enumerate(pl) if isinstance(p, Shard)}
        x = _input(world * 100 + i, shape, sharded)
        ops = _ops(len(shape) - 2)
        if _shuffles_fit(shape, sharded):
            ops.update(SHUFFLES)
        if world == 4:  # 4 ranks on 2 cores: each op once on the 2 x 2 layouts
            ops = {k: f for k, f in ops.items() if k not in WORLD4_SKIPS}
        for name, fn in ops.items():
            tag = f"@{world} {label} {name}"
            check_fn(fn, x, dmesh, pl, tag, failures, param_shapes=_statistics(shape, dmesh, pl))
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reshaping_ops_exact_on_every_layout(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, reshape_grid, world)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
