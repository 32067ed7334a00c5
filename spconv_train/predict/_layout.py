"""Where a rank's piece of an image (or volume) lies, and how the pieces are stitched.

``predict`` splits an image over the ranks of one spatial group: width strips on the
``("sp",)`` mesh, or H x W tiles on the ``("sp_h", "sp_w")`` mesh of ``parallel.sp: [p, q]``
(tiles numbered row by row, as ``build_mesh`` numbers its ranks). ``SpatialGroup`` holds a
rank's coordinates in that group and one process group over all of its ranks (for the
small gathers of 1-byte class indices to the group's first rank); ``stitch_image`` puts
pieces gathered in that order back together (``spconv_train.data.stitch_grid``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spconv_train.data import stitch_grid
from spconv_train.distributed import spatial_mesh
from spconv_train.parallel import gloo_threads_idle
from spconv_train.train.mesh_coords import MeshCoords

__all__ = ["SpatialGroup"]


@dataclass(frozen=True)
class SpatialGroup:
    """This rank's place among the ranks that share one image.

    Attributes:
        mesh: the spatial sub-mesh (``("sp",)`` or ``("sp_h", "sp_w")``).
        group: a process group over all ranks of ``mesh``, ranked like ``coords.sp_rank``.
        coords: the mesh coordinates (rows / columns of this rank's piece).
    """

    mesh: DeviceMesh
    group: dist.ProcessGroup
    coords: MeshCoords

    @classmethod
    def of(cls, mesh: DeviceMesh) -> SpatialGroup:
        """The group of a ``build_mesh`` mesh (collective: every rank must call it)."""
        sub, coords = spatial_mesh(mesh), MeshCoords.of(mesh)
        if sub.ndim == 1:
            return cls(sub, sub.get_group(), coords)
        # A tile mesh has one group per mesh dim; the gathers need one over the whole
        # tile grid of each replica. new_group is collective over the world: every rank
        # creates every replica's group, in the same order, and keeps its own.
        mine = None
        with gloo_threads_idle():  # the new groups' threads (parallel/_comm_threads.py)
            for ranks in mesh.mesh.reshape(coords.dp, coords.sp).tolist():
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        return cls(sub, mine, coords)

    @property
    def size(self) -> int:
        """Ranks sharing one image."""
        return self.coords.sp

    @property
    def rank(self) -> int:
        """This rank's index among them (row by row for tiles)."""
        return self.coords.sp_rank

    @property
    def grid(self) -> tuple[int, int]:
        """``(tile rows, tile columns)``; ``(1, sp)`` for width strips."""
        return self.coords.sp_h, self.coords.sp // self.coords.sp_h

    @property
    def placements(self) -> list:
        """Placements of an NCHW image on ``mesh``."""
        return self.coords.spatial_placements

    def rows(self, height: int) -> tuple[int, int]:
        """This rank's rows ``[r, s)`` of ``height`` rows (all of them for strips)."""
        return self.coords.rows(height)

    def cols(self, width: int) -> tuple[int, int]:
        """This rank's columns ``[a, b)`` of ``width`` columns."""
        return self.coords.cols(width)

    def stitch_image(self, parts: Sequence[np.ndarray], row_axis: int = 0) -> np.ndarray:
        """Stitch the group's pieces of an image (in group order; columns on the axis after
        ``row_axis``) back together."""
        return stitch_grid(parts, self.grid, (row_axis, row_axis + 1))
