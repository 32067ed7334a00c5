"""How a sharded DTensor is laid out on its mesh (``spatial_layout``: one spatial dim over
one mesh dim, strips, or several, one mesh dim each, tiles and volume blocks; other mesh dims
shard the batch or replicate), and the way in and out of local code (``enter`` / ``leave``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._dims import GRID_MESH_DIMS, ParallelDims, local_of, mesh_group, mesh_rank, wrap_local
from ._errors import module_path
from ._geometry import SpatialShardingError, shard_bounds
from ._halo import sum_grad_over
from ._layout import grad_in_layout, in_layout
from ._runtime import current_runtime

#: Per tensor rank: the tensor dims that may be sharded spatial dims (NCL, NCHW, NCDHW).
SPATIAL_DIMS_BY_NDIM = {3: (2,), 4: (2, 3), 5: (2, 3, 4)}


def sharded_dim(placement) -> int | None:
    """The tensor dim ``placement`` splits, or ``None`` (``Replicate``, ``Partial``). THE
    test for "is this sharded?": a ``_StridedShard`` (``x.flatten(2)`` of a ``Shard(3)``
    tensor) splits its data too, but in torch 2.14 its ``is_shard()`` is False; read as
    replicated it would silently drop the sum of parameter gradients over the ranks."""
    if placement.is_shard() or isinstance(placement, _StridedShard):
        return placement.dim
    return None


def sharding_mesh_dims(placements) -> tuple[int, ...]:
    """Mesh dimensions whose placement splits a tensor dimension (see ``sharded_dim``)."""
    return tuple(i for i, p in enumerate(placements) if sharded_dim(p) is not None)


def grad_groups(x: DTensor, exclude=()) -> tuple:
    """The process groups of the mesh dims splitting ``x`` (each holds a partial parameter
    gradient), but those of ``exclude`` (layouts with a ``mesh_dim``)."""
    skip = {lay.mesh_dim for lay in exclude}
    dims = sharding_mesh_dims(x.placements)
    return tuple(mesh_group(x.device_mesh, i) for i in dims if i not in skip)


def block_slices(shape: tuple[int, ...], placements, coords) -> tuple[slice, ...]:
    """Slices of a global tensor of ``shape`` that the rank at mesh ``coords`` (``(size,
    index)`` per mesh dim) holds under ``placements`` (DTensor's chunking, mesh dims left
    to right); ``ValueError`` for ``Partial``, ``_StridedShard``."""
    ranges = [[0, n] for n in shape]
    for p, (size, index) in zip(placements, coords, strict=True):
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            lo, hi = ranges[d]
            a, b = shard_bounds(hi - lo, size, index)
            ranges[d] = [lo + a, lo + b]
        elif not p.is_replicate():
            raise ValueError(f"a {p} placement has no contiguous block per rank")
    return tuple(slice(a, b) for a, b in ranges)


def mesh_coords(mesh: DeviceMesh) -> list[tuple[int, int]]:
    """``(size, index)`` of this rank along every mesh dim (for ``block_slices``)."""
    return [(mesh.size(i), mesh_rank(mesh, i)) for i in range(mesh.ndim)]


@dataclass(frozen=True)
class SpatialLayout:
    """A spatial op's input layout: mesh, placements, the spatial ("sp") mesh dim and the
    tensor dim split over it (``dim``; every sharded spatial dim: ``axes``)."""

    mesh: DeviceMesh
    placements: tuple
    sp_dim: int
    #: False when replicated on the sp dim (after global pooling): ``run_unsharded``
    width_sharded: bool = True
    #: the tensor dimension split over the sp ranks (the width, 3, for NCHW)
    dim: int = 3
    #: tiles: ``(tensor dim, mesh dim)`` of every sharded spatial dim (one dim: empty)
    axes: tuple[tuple[int, int], ...] = ()

    @property
    def spatial_mesh_dims(self) -> tuple[int, ...]:
        """Mesh dimensions that split the image (one for strips, one per axis for tiles)."""
        return tuple(m for _, m in self.axes) if self.axes else (self.sp_dim,)

    @property
    def spatial_groups(self) -> tuple:
        """Groups holding the other parts of one image (statistics per sample reduce here)."""
        return tuple(mesh_group(self.mesh, m) for m in self.spatial_mesh_dims)

    @property
    def sp_size(self) -> int:
        return self.mesh.size(self.sp_dim)

    @property
    def sp_rank(self) -> int:
        return mesh_rank(self.mesh, self.sp_dim)

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return mesh_group(self.mesh, self.sp_dim)

    @property
    def batch_dims(self) -> tuple[int, ...]:
        """Mesh dimensions that split a tensor dim (the batch's and the image's)."""
        return sharding_mesh_dims(self.placements)

    @property
    def grad_groups(self) -> tuple:
        """Groups over which a local parameter gradient is a partial sum (width, batch)."""
        return tuple(mesh_group(self.mesh, i) for i in self.batch_dims)

    stat_groups = grad_groups  # groups to reduce statistics over: the same


def spatial_layout(
    x: DTensor, what: str, ndim: int = 4, tiles: bool = False
) -> tuple[DTensor, SpatialLayout]:
    """``x`` and its layout, checked for a spatial op ``what`` on an ``ndim``-D input (5: a
    volume, ``layout.dim`` one of D, H, W). Replicated on the sp dim (after a global pool):
    ``width_sharded=False``, the plain local op runs (``run_unsharded``). Sharded along H
    or several dims: a tile layout (``layout.axes``), refused unless ``tiles``."""
    if x.ndim != ndim:
        kind = {3: "an NCL signal", 5: "an NCDHW volume"}.get(ndim, "an NCHW tensor")
        raise SpatialShardingError(f"{what}: expected {kind}, got shape {tuple(x.shape)}")
    placements = tuple(x.placements)
    spatial = SPATIAL_DIMS_BY_NDIM.get(ndim, ())
    sp_dims = [
        i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim in spatial
    ]
    if not sp_dims:
        names, sp = x.device_mesh.mesh_dim_names or (), ParallelDims.spatial_mesh_dim(x.device_mesh)
        # every spatial mesh dim replicates (e.g. after global pooling)
        grid = [names.index(n) for n in GRID_MESH_DIMS if n in names]
        if sp is not None and all(isinstance(placements[m], Replicate) for m in (sp, *grid)):
            _check_other_dims(placements, what, (sp,))
            return x, SpatialLayout(x.device_mesh, placements, sp, width_sharded=False)
        raise SpatialShardingError(
            f"{what} in module '{module_path()}': input placements {placements} have no Shard(3) "
            "(width) dimension. Distribute the image with distribute_tensor(img, mesh, "
            "[Shard(3)]) ([Shard(0), Shard(3)] on a (dp, sp) mesh)."
            + (" A volume (NCDHW) takes one of Shard(2), Shard(3), Shard(4)." if ndim == 5 else "")
        )
    m = sp_dims[-1]  # tiles: sharded along H (and W, D), one mesh dim each
    tiled = len(sp_dims) > 1 or (ndim == 4 and placements[m].dim % ndim == 2)
    axes = tuple(sorted((placements[i].dim % ndim, i) for i in sp_dims)) if tiled else ()
    if tiled and len({d for d, _ in axes}) != len(axes):
        raise SpatialShardingError(
            f"{what}: placements {placements} shard one image dimension over several mesh "
            f"dimensions; shard H and W over one mesh dimension each ([Shard(2), Shard(3)])."
        )
    if tiled and not tiles and ndim == 5:
        raise SpatialShardingError(
            f"{what}: is not supported on a volume sharded over several dims (placements "
            f"{placements}) yet. Shard one of D, H, W only (mesh ('sp',) or ('dp', 'sp'), "
            f"[Shard(2)], [Shard(3)] or [Shard(4)]), see docs/volumes.md."
        )
    if tiled and not tiles:
        raise SpatialShardingError(
            f"{what}: is not supported on H x W tiles (placements {placements}) yet. Shard "
            f"the width only (mesh ('sp',) or ('dp', 'sp'), [Shard(3)]), see docs/tiles.md."
        )
    _check_other_dims(placements, what, sp_dims)
    dim, m = axes[-1] if tiled else (placements[m].dim % ndim, m)
    return x, SpatialLayout(x.device_mesh, placements, m, dim=dim, axes=axes)


def _check_other_dims(placements: tuple, what: str, spatial) -> None:
    """Refuse a ``Partial``, or a non-batch dim split on a mesh dim not in ``spatial``."""
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise SpatialShardingError(
                f"{what}: input placement {placements} holds a Partial (pending sum) on mesh "
                f"dimension {i}; reducing it would move a whole activation. Redistribute to "
                f"Shard/Replicate explicitly before this layer."
            )
        if sharded_dim(p) not in (None, 0) and i not in spatial:
            raise SpatialShardingError(
                f"{what}: mesh dimension {i} shards tensor dim {p.dim}; only the batch (dim 0) "
                f"may be sharded besides the width."
            )


def run_unsharded(x: DTensor, layout: SpatialLayout, fn, *params) -> DTensor:
    """``fn(local, *params)`` on a DTensor whose width is *not* sharded (DeepLabV3's pooled
    1x1 map): exact on whole rows; parameter gradients summed over the batch shards only."""
    groups = layout.grad_groups
    out = fn(enter(x), *(sum_grad_over(p, groups) for p in params))
    return leave(out, layout, (x.shape[0], *out.shape[1:]))


def enter(x: DTensor, grad_placements: tuple | None = None) -> Tensor:
    """The local strip of ``x`` (differentiable, canonical strides); ``grad_placements``
    labels the gradient flowing back (``Partial`` on sp: a replicated input used in part);
    ``x`` noted in the runtime (``input_share``, ``last_image``)."""
    if not torch.compiler.is_compiling():
        rt, share = current_runtime(), x.numel() // x.device_mesh.size()
        if x.ndim == 4:
            rt.last_image = (x.device_mesh, tuple(x.placements), tuple(x.shape))
        if share > rt.input_share:
            rt.input_share = share
    return in_layout(local_of(x, grad_placements))


def leave(local: Tensor, like: SpatialLayout, global_shape: tuple[int, ...]) -> DTensor:
    """A local strip as a DTensor of ``global_shape`` laid out like the input; the backward
    redistributes a gradient of any placement to it (canonical channels-last)."""
    return wrap_local(grad_in_layout(local), like.mesh, like.placements, global_shape)
