"""How a width-sharded DTensor is laid out on its mesh, and the way in and out of local code.

A spatial op receives a DTensor whose placements hold exactly one ``Shard(3)`` (the spatial,
"sp" mesh dimension); other mesh dimensions may be ``Shard(0)`` (data parallel: each rank a
different part of the batch) or ``Replicate``. ``SpatialLayout`` reads that off the input,
``enter`` hands the local strip to local code (differentiably), and ``leave`` wraps the
local result back into a DTensor with the global shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ._geometry import SpatialShardingError

WIDTH_DIM = 3


def _is_width_shard(p) -> bool:
    return isinstance(p, Shard) and p.dim in (WIDTH_DIM, -1)


@dataclass(frozen=True)
class SpatialLayout:
    """The mesh, the spatial mesh dimension and this rank's place in it."""

    mesh: DeviceMesh
    placements: tuple
    sp_dim: int

    @property
    def sp_size(self) -> int:
        return self.mesh.size(self.sp_dim)

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank(self.sp_dim)

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.sp_dim)

    @property
    def batch_dims(self) -> tuple[int, ...]:
        """Mesh dimensions that shard the batch (data parallel)."""
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Shard))

    @property
    def grad_groups(self) -> tuple:
        """Groups over which a parameter gradient computed on the local data is a partial sum:
        every mesh dimension that shards the activation (width or batch)."""
        return tuple(
            self.mesh.get_group(i) for i, p in enumerate(self.placements) if isinstance(p, Shard)
        )

    @property
    def stat_groups(self) -> tuple:
        """Groups to reduce statistics over (same as ``grad_groups``)."""
        return self.grad_groups


def spatial_layout(x: DTensor, what: str) -> tuple[DTensor, SpatialLayout]:
    """Check ``x`` is laid out for a spatial op and return it (possibly re-sharded) with its
    layout. A width-replicated input on a mesh with an "sp" dimension is sharded locally (no
    communication); anything else that is not width-sharded is refused with a clear error."""
    if x.ndim != 4:
        raise SpatialShardingError(f"{what}: expected an NCHW tensor, got shape {tuple(x.shape)}")
    placements = tuple(x.placements)
    sp_dims = [i for i, p in enumerate(placements) if _is_width_shard(p)]
    if not sp_dims:
        names = x.device_mesh.mesh_dim_names or ()
        if "sp" in names and isinstance(placements[names.index("sp")], Replicate):
            i = names.index("sp")
            new = list(placements)
            new[i] = Shard(WIDTH_DIM)
            x = x.redistribute(x.device_mesh, new)
            placements = tuple(new)
            sp_dims = [i]
        else:
            raise SpatialShardingError(
                f"{what}: input placements {placements} have no Shard(3) (width) dimension. "
                f"Distribute the image with distribute_tensor(img, mesh, [Shard(3)]) "
                f"([Shard(0), Shard(3)] on a (dp, sp) mesh)."
            )
    if len(sp_dims) > 1:
        raise SpatialShardingError(
            f"{what}: the width is sharded over several mesh dimensions {placements}; "
            f"spconv-train shards the width over exactly one ('sp')."
        )
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise SpatialShardingError(
                f"{what}: input placement {placements} holds a Partial (pending sum) on mesh "
                f"dimension {i}; reducing it would move a whole activation. Redistribute to "
                f"Shard/Replicate explicitly before this layer."
            )
        if isinstance(p, Shard) and i != sp_dims[0] and p.dim != 0:
            raise SpatialShardingError(
                f"{what}: mesh dimension {i} shards tensor dim {p.dim}; only the batch (dim 0) "
                f"may be sharded besides the width."
            )
    return x, SpatialLayout(x.device_mesh, placements, sp_dims[0])


def enter(x: DTensor) -> Tensor:
    """The local strip of ``x`` (differentiable)."""
    return x.to_local()


def leave(local: Tensor, like: SpatialLayout, global_shape: tuple[int, ...]) -> DTensor:
    """Wrap a local strip into a DTensor of ``global_shape`` laid out like the input.

    The backward of ``from_local`` redistributes an incoming gradient of any placement
    (``Replicate``, ``Partial``, ...) to this layout before handing it to local code.
    """
    stride = []
    acc = 1
    for n in reversed(global_shape):
        stride.append(acc)
        acc *= n
    return DTensor.from_local(
        local,
        like.mesh,
        like.placements,
        run_check=False,
        shape=tuple(global_shape),
        stride=tuple(reversed(stride)),
    )
