"""``full_tensor()`` / ``redistribute()`` of the pixel tokens of a map split over two mesh
dims (H x W tiles, rows: one token dim nested over ``sp_h`` and ``sp_w``, ``_tokens.py``).
DTensor reads those placements as its own chunking, which differs from the nesting; the
calls either equal the one-device tokens or raise ``SpatialShardingError`` naming the call
and the way out (``_errors.install_guards``), never return wrong values. Even and
uneven maps on 2 x 2 tiles and on rows, and an implicit redistribution (DTensor's own
``cumsum`` along the token dim); the advised reshape back to the map gathers exactly."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import device, mesh
from tests.reference import seeded


def outcomes(mshape: tuple[int, int]) -> dict[str, str]:
    """``{case: "equal" | "refused" | failure text}`` for every map size and call."""
    dmesh = mesh(mshape, ("sp_h", "sp_w"))  # no model parallelized on it (dist_harness)
    found = {}
    for h, w in ((4, 6), (5, 7)):
        x = seeded(1, 2, 3, h, w, dtype=torch.float64).to(device())
        with SpatialMode():  # the handlers: the tokens' nested layout (_tokens.py)
            tokens = distribute_tensor(x, dmesh, [Shard(2), Shard(3)]).flatten(2).transpose(1, 2)
            back = tokens.transpose(1, 2).reshape(2, 3, h, w)
        want = x.flatten(2).transpose(1, 2)
        calls = {  # name in the refusal: (call, its one-device result)
            "DTensor.full_tensor()": (tokens.full_tensor, want),
            "DTensor.redistribute()": (
                lambda t=tokens: t.redistribute(dmesh, [Replicate()] * 2).to_local(),
                want,
            ),
            # DTensor's own cumsum along the split dim redistributes the tokens implicitly
            "implicit redistribution for aten.cumsum": (
                lambda t=tokens: t.cumsum(1).redistribute(dmesh, [Replicate()] * 2).to_local(),
                want.cumsum(1),
            ),
        }
        for name, (call, result) in calls.items():
            case = f"{h}x{w} {name}"
            try:
                got = call()
            except SpatialShardingError as exc:
                text = str(exc)
                named = name in text and "(B, C, H, W)" in text
                found[case] = "refused" if named else f"refused without naming it: {text[:200]}"
                continue
            found[case] = "equal" if torch.allclose(got, result, 1e-14) else "WRONG VALUES"
        found[f"{h}x{w} map"] = "equal" if torch.equal(back.full_tensor(), x) else "WRONG MAP"
    return found


@pytest.mark.parametrize(
    "world, mshape, refused",
    [
        (4, (2, 2), ("4x6", "5x7")),  # 2 x 2 tiles: DTensor misreads even and uneven tiles
        (2, (2, 1), ("5x7",)),  # rows: even rows read the same, uneven ones do not
    ],
)
def test_tile_tokens_gather_exactly_or_refuse(dist_pool, world, mshape, refused):
    for rank, found in enumerate(dist_pool.run(world, outcomes, mshape)):
        for case, result in found.items():
            want = "refused" if case.split()[0] in refused and "map" not in case else "equal"
            assert result == want, f"rank {rank} {case}: {result}"
