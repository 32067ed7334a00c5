"""``torch.unbind`` and ``F.unfold`` (kernel 3, padding 1, default stride) of sharded maps.

``unbind`` along a dim no rank splits (the channels of a map, of its pixel tokens) runs on
the local part: with DTensor's own rule the backward stacked plain zeros (the unused pieces'
gradients) next to DTensors ("aten.stack.default got mixed torch.Tensor and DTensor").
Along a split dim it is refused by name. ``F.unfold``'s tokens ``(N, C k k, L)`` are those
of ``flatten(2)`` of the map (pixel tokens, uneven per rank), exact when the model goes on
with them (back to the map, a linear layer on the tokens, a loss). fp64 output and input
gradient against one device, no-gather audit (``tests/op_check.check_fn``), uneven W strips
and tiles (H x W, H split), 2 and 3 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn
from tests.reference import seeded


def _layouts(world: int) -> list:
    """``(label, mesh, placements)``: W strips, tiles split along H, tiles split along W."""
    return [
        (f"W {world}", *mesh_and_placements((world,), ("sp_w",))),
        (f"tiles {world}x1", *mesh_and_placements((world, 1), ("sp_h", "sp_w"))),
        (f"tiles 1x{world}", *mesh_and_placements((1, world), ("sp_h", "sp_w"))),
    ]


def _back(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Pixel tokens ``(N, L)`` of the map ``m`` as a one-channel map, times ``m``."""
    return t.reshape(m.shape[0], 1, *m.shape[2:]) * m


def _tokens(m: torch.Tensor) -> torch.Tensor:
    return m.flatten(2).transpose(1, 2)


UNBIND = {
    "torch.unbind(m, 1)": lambda m: torch.unbind(m, 1),
    "m.unbind(dim=1)": lambda m: m.unbind(dim=1),
    "torch.unbind(m, -3) two used": lambda m: (lambda a, b, c: a * b + 1)(*torch.unbind(m, -3)),
    "unbind of a batch of one": lambda m: m[:1].unbind(0)[0] * 2,
    "tokens unbind(2)": lambda m: _back(_tokens(m).unbind(2)[1], m),
    "tokens unbind(-1) two used": lambda m: _back(
        (lambda a, b, c: a - c)(*_tokens(m).unbind(-1)), m
    ),
}

UNFOLD = {
    "F.unfold(m, 3, padding=1) back to the map": lambda m: F.unfold(m, 3, padding=1).view(
        m.shape[0], -1, *m.shape[2:]
    ),
    "F.unfold(m, 3, padding=1) linear on the tokens": lambda m: (
        F.linear(
            F.unfold(m, 3, padding=1).transpose(1, 2), seeded(8, 2, 9 * m.shape[1], dtype=m.dtype)
        )
        .transpose(1, 2)
        .reshape(m.shape[0], 2, *m.shape[2:])
    ),
    "F.unfold(m, 3, padding=1) summed": lambda m: _back(F.unfold(m, 3, padding=1).sum(1), m),
    "F.unfold(m, 3, 1, 1, 1) squared sum": lambda m: F.unfold(m, 3, 1, 1, 1).square().sum(),
}


def _failures(kind: str) -> list[str]:
    """Every form of ``kind`` ("unbind", "unfold") on every layout: the failures."""
    forms, world, failures = {"unbind": UNBIND, "unfold": UNFOLD}[kind], dist.get_world_size(), []
    x = seeded(7, 2, 3, 3 * world - 1, 3 * world + 1, dtype=torch.float64)  # uneven H and W
    for label, dmesh, placements in _layouts(world):
        for name, fn in forms.items():
            check_fn(fn, x, dmesh, placements, f"{label} {name}", failures)
    return failures


def _refusals() -> list[str]:
    """``unbind`` along a split dim (W of strips, H and W of tiles): refused by name (on
    main too, by DTensor's message; here before DTensor runs)."""
    world, failures = dist.get_world_size(), []
    x = seeded(7, 2, 3, 3 * world - 1, 3 * world + 1, dtype=torch.float64)
    for label, dmesh, placements in _layouts(world):
        xs = distribute_tensor(x, dmesh, placements)
        for d in (p.dim for p, n in zip(placements, dmesh.shape, strict=True) if n > 1):
            try:
                with SpatialMode():
                    xs.unbind(d)
                failures.append(f"{label} unbind({d}): not refused")
            except SpatialShardingError as exc:
                if "unbind" not in str(exc):
                    failures.append(f"{label} unbind({d}): {exc}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["unbind", "unfold"])
def test_matches_one_device(dist_pool, world, kind):
    for rank, failures in enumerate(dist_pool.run(world, _failures, kind)):
        assert not failures, f"world {world} rank {rank}: " + "\n".join(failures[:8])


@pytest.mark.parametrize("world", [2, 3])
def test_unbind_along_a_split_dim_is_refused_by_name(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, _refusals)):
        assert not failures, f"world {world} rank {rank}: " + "\n".join(failures[:8])
