"""Where this rank sits on the training mesh, and the wrap of its local piece of a sample
into a DTensor of the global shape (no communication): shared by the training feed,
validation, ``verify`` and ``predict``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from spconv_train.data import strip_bounds
from spconv_train.parallel import ParallelDims

__all__ = ["MeshCoords", "to_dtensor"]


@dataclass(frozen=True)
class MeshCoords:
    """This rank's place on the ``("dp", "sp")`` mesh, or on a mesh of tiles or blocks
    (``("dp", "sp_h", "sp_w")`` for H x W image tiles; two or three of ``sp_d``, ``sp_h``,
    ``sp_w`` for volume blocks). Then ``sp`` counts all spatial ranks, ``sp_rank`` numbers
    them row-major over the spatial mesh dims, ``sp_d`` / ``sp_h`` are the ranks along D
    and H (1 when not split) and ``names`` the spatial mesh dims."""

    dp: int
    sp: int
    dp_rank: int
    sp_rank: int
    sp_h: int = 1
    """Rows of tiles (1 for width strips)."""
    tiled: bool = False
    """Whether the data is split over a mesh of tiles or blocks (not ``("dp", "sp")``)."""
    sp_d: int = 1
    """Ranks along D (volume blocks only)."""
    names: tuple[str, ...] = (ParallelDims.SP,)
    """The spatial mesh dims, in mesh order."""

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshCoords:
        """Read the coordinates off a ``build_mesh`` mesh (strips, tiles or blocks)."""
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 2 and names[1:] in ((), (ParallelDims.SP,)):
            return cls(mesh.size(0), mesh.size(1), mesh.get_local_rank(0), mesh.get_local_rank(1))
        sizes = {names[k]: mesh.size(k) for k in range(1, mesh.ndim)}
        sp_rank = 0
        for k in range(1, mesh.ndim):  # row-major, as init_device_mesh numbers the ranks
            sp_rank = sp_rank * mesh.size(k) + mesh.get_local_rank(k)
        return cls(
            mesh.size(0),
            math.prod(sizes.values()),
            mesh.get_local_rank(0),
            sp_rank,
            sizes.get(ParallelDims.AXIS["H"], 1),
            tiled=True,
            sp_d=sizes.get(ParallelDims.AXIS["D"], 1),
            names=names[1:],
        )

    @property
    def spatial_placements(self) -> list:
        """Placements of an image on the spatial sub-mesh: ``[Shard(3)]`` or H and W."""
        return self.tile_placements(4) if self.tiled else [Shard(3)]

    def tile_placements(self, ndim: int) -> list:
        """Placements on the spatial sub-mesh of tiles or blocks of an ``ndim``-dim tensor:
        ``sp_w`` shards its last dim, ``sp_h`` the one before, ``sp_d`` the one before that."""
        return [Shard(ndim - ParallelDims.dims_from_end(name)) for name in self.names]

    @property
    def _sp_w(self) -> int:
        return self.sp // (self.sp_d * self.sp_h)

    def planes(self, depth: int) -> tuple[int, int]:
        """This rank's slices ``[a, b)`` of a volume ``depth`` slices deep (all, unless
        blocks split D)."""
        return strip_bounds(depth, self.sp_d, self.sp_rank // (self.sp_h * self._sp_w))

    def rows(self, height: int) -> tuple[int, int]:
        """This rank's rows ``[r, s)`` of an image ``height`` rows high (all, for strips)."""
        return strip_bounds(height, self.sp_h, (self.sp_rank // self._sp_w) % self.sp_h)

    def cols(self, width: int) -> tuple[int, int]:
        """This rank's columns ``[a, b)`` of an image ``width`` columns wide."""
        return strip_bounds(width, self._sp_w, self.sp_rank % self._sp_w)


def to_dtensor(local: Tensor, mesh: DeviceMesh, placements: list, shape: tuple) -> DTensor:
    """Wrap a local strip into a DTensor of global ``shape`` (contiguous strides), no
    communication."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=tuple(shape),
        stride=tuple(reversed(stride)),
    )
