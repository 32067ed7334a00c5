"""Tensor dims and mesh dims: which tensor dims a DTensor's placements shard, wrapping a
local result back, cached mesh lookups, and ``ParallelDims`` (the mesh dim names). Placements
other than plain ``Shard`` / ``Replicate`` (``handled`` False) are left to DTensor's rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._dtensor_wrap import wrap_local


def handled(x) -> bool:
    """True for a DTensor whose placements are all exactly ``Shard`` or ``Replicate``."""
    return isinstance(x, DTensor) and all(type(p) in (Shard, Replicate) for p in x.placements)


def norm_dim(d: int, ndim: int) -> int:
    """``d`` as a non-negative dimension index of an ``ndim``-D tensor."""
    if not -ndim <= d < max(ndim, 1):
        raise IndexError(f"dimension {d} out of range for a {ndim}-D tensor")
    return d % ndim if ndim else 0


def sharded_dims(x: DTensor) -> dict[int, int]:
    """``{tensor dim: mesh dim}`` for every sharded dimension of ``x`` (non-negative)."""
    return {norm_dim(p.dim, x.ndim): i for i, p in enumerate(x.placements) if isinstance(p, Shard)}


#: ``from_local(local, mesh, placements, shape)``: ``local`` as a DTensor of the contiguous
#: global ``shape`` (given, not inferred: no collective to learn the other ranks' sizes)
from_local = wrap_local


#: ``(id(mesh), mesh dim) -> (mesh, size, local rank, group)``: ``DeviceMesh.get_group`` and
#: ``get_local_rank`` cost tens of microseconds each, asked several times per layer, fixed
#: for a mesh's lifetime (each entry holds its mesh, so its id cannot be reused)
_MESH_AXES: dict[tuple[int, int | str], tuple] = {}
_MESH_AXES_MAX = 256


def mesh_axis(mesh, m: int | str) -> tuple[int, int, object]:
    """``(size, local rank, process group)`` of mesh dim ``m`` (read once per mesh and dim)."""
    hit = _MESH_AXES.get((id(mesh), m))
    if hit is None or hit[0] is not mesh:
        if len(_MESH_AXES) >= _MESH_AXES_MAX:  # bounded: meshes built in a loop
            _MESH_AXES.clear()
        hit = (mesh, mesh.size(m), mesh.get_local_rank(m), mesh.get_group(m))
        _MESH_AXES[(id(mesh), m)] = hit
    return hit[1:]


def mesh_rank(mesh, m: int | str) -> int:
    """This rank's index along mesh dim ``m`` (``mesh.get_local_rank(m)``, cached)."""
    return mesh_axis(mesh, m)[1]


def mesh_group(mesh, m: int | str):
    """The process group of mesh dim ``m`` (``mesh.get_group(m)``, cached)."""
    return mesh_axis(mesh, m)[2]


def wrap(local: Tensor, x: DTensor, placements, shape) -> DTensor:
    """``local`` as a DTensor on ``x``'s mesh with ``placements`` and global ``shape``."""
    return from_local(local, x.device_mesh, placements, shape)


#: The data-parallel mesh dim (shards the batch) and the one-split-dim spatial mesh dim.
DP, SP = "dp", "sp"
#: The mesh dim that splits each spatial axis of a grid (tiles, volume blocks), D, H, W order.
AXIS_MESH_DIMS = {"D": "sp_d", "H": "sp_h", "W": "sp_w"}
GRID_MESH_DIMS = tuple(AXIS_MESH_DIMS.values())


def is_dp(x: DTensor, mesh_dim: int) -> bool:
    """Whether ``mesh_dim`` of ``x``'s mesh is the data-parallel one (splits whole images)."""
    return (x.device_mesh.mesh_dim_names or ())[mesh_dim : mesh_dim + 1] == (DP,)


@dataclass(frozen=True)
class ParallelDims:
    """The mesh dims of a run and what each shards (as torchtitan's ``ParallelDims``):
    ``dp`` splits the batch; the spatial ranks split an image along one dim over ``sp``
    (strips) or along several, one mesh dim each (``grid``: ``sp_d`` / ``sp_h`` / ``sp_w``)."""

    #: the names, for code that reads a mesh: ``ParallelDims.DP``, ``ParallelDims.SP``,
    #: ``ParallelDims.AXIS["H"]`` (the grid dim splitting H), ``ParallelDims.GRID``
    DP: ClassVar[str] = DP
    SP: ClassVar[str] = SP
    AXIS: ClassVar[Mapping[str, str]] = AXIS_MESH_DIMS
    GRID: ClassVar[tuple[str, ...]] = GRID_MESH_DIMS

    dp: int = 1
    sp: int = 1
    #: ``((mesh dim name, ranks), ...)`` of a grid, in D, H, W order; empty for strips
    grid: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        names = [n for n, _ in self.grid]
        if [n for n in GRID_MESH_DIMS if n in names] != names:
            raise ValueError(f"grid {self.grid}: names must be among {GRID_MESH_DIMS}, in order")
        if self.grid and math.prod(n for _, n in self.grid) != self.sp:
            shown = "x".join(str(n) for _, n in self.grid)
            raise ValueError(f"grid {shown} does not hold sp={self.sp} ranks")

    @classmethod
    def of(cls, dp: int, sp: int, grid: Mapping[str, int] | tuple[int, int] | None = None):
        """From ``build_mesh``'s arguments: a grid ``(p, q)`` is H x W tiles, a mapping
        names its mesh dims (``config.grid_mesh_dims``)."""
        if grid is not None and not isinstance(grid, Mapping):
            grid = {AXIS_MESH_DIMS["H"]: grid[0], AXIS_MESH_DIMS["W"]: grid[1]}
        return cls(dp, sp, tuple(grid.items()) if grid is not None else ())

    @property
    def names(self) -> tuple[str, ...]:
        """Every mesh dim name, ``dp`` first."""
        return (DP, *(n for n, _ in self.grid)) if self.grid else (DP, SP)

    @property
    def shape(self) -> tuple[int, ...]:
        """Ranks per mesh dim, in ``names`` order."""
        return (self.dp, *(n for _, n in self.grid)) if self.grid else (self.dp, self.sp)

    @staticmethod
    def spatial_names_of(mesh) -> tuple[str, ...]:
        """The spatial mesh dim names of ``mesh`` (every dim but ``dp``)."""
        return tuple(n for n in mesh.mesh_dim_names or () if n != DP)

    @staticmethod
    def dims_from_end(name: str) -> int:
        """How far from the last the dim ``name`` splits is: ``sp_w`` 1, ``sp_h`` 2, ``sp_d`` 3."""
        return len(GRID_MESH_DIMS) - GRID_MESH_DIMS.index(name)

    @staticmethod
    def spatial_mesh_dim(mesh) -> int | None:
        """The index of ``mesh``'s spatial dim that ops treat as *the* spatial one: the only
        dim of a 1-D mesh, ``sp``, or the last grid dim present (``None``: none named)."""
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            return 0
        found = [names.index(n) for n in (*GRID_MESH_DIMS, SP) if n in names]
        return max(found) if found else None
