"""The per-mesh set-up the tile and volume tests share: a (cached) mesh from its shape and
dim names, and the placements that shard a tensor over it (``dp`` shards the batch, each
``sp_d`` / ``sp_h`` / ``sp_w`` its spatial dim). Runs inside the harness workers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch.distributed.tensor import Shard

from tests.dist_harness import mesh

#: the spatial mesh dim names, in the order of the tensor's trailing dims
_SPATIAL = ("sp_d", "sp_h", "sp_w")


def placements(names: tuple[str, ...], ndim: int = 4) -> list[Shard]:
    """``Shard`` per mesh dim of ``names`` for an ``ndim``-D tensor (NCHW or NCDHW):
    ``dp`` -> the batch, ``sp_h`` -> H, ``sp_w`` -> W, ``sp_d`` -> D."""
    return [Shard(0) if n == "dp" else Shard(ndim - 3 + _SPATIAL.index(n)) for n in names]


def mesh_and_placements(shape: tuple[int, ...], names: tuple[str, ...], ndim: int = 4):
    """``(mesh, placements)`` of the mesh ``shape`` named ``names``."""
    return mesh(shape, names), placements(names, ndim)


def each_mesh(specs: Iterable[tuple[tuple[int, ...], tuple[str, ...]]], ndim: int = 4) -> Iterator:
    """``(mesh, placements, label)`` for every ``(shape, names)`` of ``specs``."""
    for shape, names in specs:
        yield (*mesh_and_placements(shape, names, ndim), f"mesh {shape}")
