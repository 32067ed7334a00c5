"""The halo exchange itself: plan arithmetic, forward slices, and the adjoint identity."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import (
    ExchangePlan,
    all_shard_bounds,
    gather_columns,
    shard_bounds,
)
from tests.dist_harness import mesh
from tests.reference import seeded


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_shard_bounds_match_torch_chunk(parts):
    for width in range(1, 21):
        chunks = torch.arange(width).chunk(parts)
        for r in range(parts):
            a, b = shard_bounds(width, parts, r)
            want = chunks[r].tolist() if r < len(chunks) else []
            assert list(range(a, b)) == want, (width, parts, r)


def test_plan_pieces_and_neighbour_check():
    owned = tuple(all_shard_bounds(10, 3))  # (0,4) (4,8) (8,10)
    plan = ExchangePlan(10, owned, (((0, 5),), ((3, 9),), ((7, 10),)))
    assert plan.pieces(1) == [(0, 3, 4), (1, 4, 8), (2, 8, 9)]
    assert plan.sends(1) == [(0, 4, 5), (2, 7, 8)]
    plan.check_neighbours("ok")
    far = ExchangePlan(10, owned, (((0, 9),), ((4, 8),), ((8, 10),)))
    with pytest.raises(
        SpatialShardingError, match="rank 0 needs columns \\[8, 9\\) held by rank 2"
    ):
        far.check_neighbours("layer x")
    wrap = ExchangePlan(10, owned, (((9, 10), (0, 5)), ((4, 8),), ((8, 10), (0, 1))), wrap=True)
    wrap.check_neighbours("circular")  # first and last rank may talk when wrapping


def _random_plan(rng: random.Random, width: int, world: int, wrap: bool) -> ExchangePlan:
    owned = all_shard_bounds(width, world)
    needed = []
    for r, (a, b) in enumerate(owned):
        lo = rng.randint(max(0, a - (b - a) + 1) if r else 0, a + 1)
        hi = rng.randint(min(b, width) - 1, min(width, b + rng.randint(0, 3)))
        ivs = [(lo, max(hi, lo + 1))]
        if wrap and r == 0:
            ivs.insert(0, (width - 2, width))
        if wrap and r == world - 1:
            ivs.append((0, 2))
        needed.append(tuple(ivs))
    return ExchangePlan(width, tuple(owned), tuple(needed), wrap=wrap)


def exchange_checks(world: int, trials: int) -> list[str]:
    """Forward equals global slicing; <E x, y> == <x, E^T y> summed over ranks."""
    dmesh = mesh(world)
    group, rank = dmesh.get_group(0), dmesh.get_local_rank(0)
    rng = random.Random(1234)
    failures = []
    for t in range(trials):
        width = rng.randint(4 * world, 9 * world)
        plan = _random_plan(rng, width, world, wrap=t % 2 == 1 and world > 1)
        x_full = seeded(t, 2, 3, 4, width, dtype=torch.float64)
        a, b = plan.owned[rank]
        x = x_full[..., a:b].clone().requires_grad_()
        ex = gather_columns(x, plan, rank, group)
        want = torch.cat([x_full[..., lo:hi] for lo, hi in plan.needed[rank]], dim=-1)
        if not torch.equal(ex.detach(), want):
            failures.append(f"trial {t}: forward differs from global slicing, plan {plan}")
        y = seeded(10_000 + 97 * t + rank, *ex.shape, dtype=torch.float64)
        (ety,) = torch.autograd.grad(ex, x, y)
        sums = torch.stack([(ex.detach() * y).sum(), (x.detach() * ety).sum()])
        dist.all_reduce(sums, group=group)
        if abs(sums[0] - sums[1]) > 1e-10 * abs(sums[0]).clamp(min=1):
            failures.append(f"trial {t}: <Ex,y>={sums[0]:.12g} != <x,E^T y>={sums[1]:.12g}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exchange_forward_and_adjoint(dist_pool, world):
    failures = dist_pool.run(world, exchange_checks, world, 12)[0]
    assert not failures, "\n".join(failures)


def exchange_on_2d_mesh() -> list[str]:
    """On a (dp, sp) mesh the exchange runs inside each sp group (rows of the mesh)."""
    dmesh = mesh((2, 2))
    group, rank = dmesh.get_group("sp"), dmesh.get_local_rank("sp")
    dp = dmesh.get_local_rank("dp")
    plan = ExchangePlan(9, ((0, 5), (5, 9)), (((0, 7),), ((3, 9),)))
    x_full = seeded(dp, 1, 2, 3, 9)  # each dp row holds a different image
    a, b = plan.owned[rank]
    got = gather_columns(x_full[..., a:b].clone(), plan, rank, group)
    lo, hi = plan.needed[rank][0]
    return [] if torch.equal(got, x_full[..., lo:hi]) else [f"dp {dp} sp {rank} wrong columns"]


def test_exchange_uses_the_sp_group_of_a_2d_mesh(dist_pool):
    for failures in dist_pool.run(4, exchange_on_2d_mesh):
        assert not failures, failures
