"""Validation images that cannot run at this many ranks are reported before training.

Training batches are cropped to ``data.height x data.width``, so the first training step
finds a crop too narrow for the mesh. Validation runs on whole images of any size; without
this check, an image too narrow for ``parallel.sp`` ranks (a strip narrower than a layer's
halo, or an empty strip deep in the network) stops the run only at the first validation,
after ``training.val_every`` steps of work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from spconv_train.config import Config, spatial_grid
from spconv_train.data import DataError, SegmentationSource, strip_bounds
from spconv_train.distributed import env_world_size
from spconv_train.parallel import SpatialShardingError
from spconv_train.train.bad_samples import sample_file
from spconv_train.train.mesh_coords import MeshCoords, to_dtensor
from spconv_train.train.volume_feed import block_bounds, spatial_placements

__all__ = ["check_val_sizes", "image_grid", "is_geometry_error"]


def image_grid(cfg: Config) -> tuple[int, int]:
    """Rows x columns of spatial ranks an image is split into: ``parallel.sp`` ``[p, q]``,
    ``(1, sp)`` for strips, ``(1, world size)`` for ``parallel.sp: 0`` not yet resolved (the
    same number of ranks, for the per-rank size limits checked before the mesh exists)."""
    grid = spatial_grid(cfg)
    if grid is not None and len(grid) == 2:
        return grid[0], grid[1]
    sp = cfg.parallel.sp if isinstance(cfg.parallel.sp, int) else 0
    if sp == 0:
        sp = dist.get_world_size() if dist.is_initialized() else env_world_size()
    return 1, sp


def is_geometry_error(exc: BaseException, sp: int) -> bool:
    """Whether a forward failed on the image's size, the same way on every rank of its
    ``sp`` group: ``SpatialShardingError`` (raised on every rank together), or a pooling
    layer's "Output size is too small" (a too-small height: the same on every strip). At
    ``sp = 1`` nothing is split and no collective runs, so the plain ops' ``RuntimeError``
    on a too-small image (max_pool2d, a kernel larger than the input) counts too."""
    if isinstance(exc, SpatialShardingError):
        return True
    return isinstance(exc, RuntimeError) and (sp == 1 or "too small" in str(exc))


@torch.no_grad()
def check_val_sizes(
    model: nn.Module,
    source: SegmentationSource,
    cfg: Config,
    coords: MeshCoords,
    sp_mesh: DeviceMesh,
    device: torch.device,
) -> None:
    """Run the parallelized ``model`` once (eval mode, no gradients, zeros) on every distinct
    validation image size other than the training crop (collective over ``sp_mesh``: every
    replica checks every size). Raises ``DataError`` naming the first image of a size
    that cannot run, on every rank together (the geometry is the same on every rank)."""
    d = cfg.data
    placements = spatial_placements(cfg, coords)
    crop = (d.depth, d.height, d.width) if d.kind == "volume" else (d.height, d.width)
    sizes: dict[tuple[int, ...], int] = {}
    for i in range(len(source)):
        sizes.setdefault(source.size(i), i)
    sizes.pop(crop, None)
    if not sizes:
        return
    was_training = model.training
    model.eval()
    try:
        for size, i in sizes.items():
            c = source.channels(i)
            if d.kind == "volume":  # a block along one or several dims
                block = [b - a for a, b in block_bounds(cfg, coords, size)]
            elif coords.tiled:  # an H x W tile
                (r, s), (a, b) = coords.rows(size[0]), coords.cols(size[1])
                block = [s - r, b - a]
            else:
                a, b = strip_bounds(size[1], coords.sp, coords.sp_rank)
                block = [size[0], b - a]
            x = torch.zeros(1, c, *block, device=device)
            bf16 = cfg.training.precision == "bf16"  # as validation runs it (memory)
            try:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    model(to_dtensor(x, sp_mesh, placements, (1, c, *size)))
            except (SpatialShardingError, RuntimeError) as exc:
                if not is_geometry_error(exc, coords.sp):
                    raise
                split = cfg.parallel.sp if coords.tiled else coords.sp
                raise DataError(
                    f"{sample_file(source, i)}: validation image {'x'.join(map(str, size))} "
                    f"({'DxHxW' if len(size) == 3 else 'HxW'}) cannot run through "
                    f"{cfg.model.name} split over parallel.sp={split} rank(s): {exc}. "
                    "Remove it from the validation split, or use a smaller parallel.sp"
                    + (
                        " (fewer tile rows for a short image)"
                        if len(size) == 2 and coords.tiled
                        else ""
                    ),
                    path=sample_file(source, i),
                ) from exc
    finally:
        model.train(was_training)
