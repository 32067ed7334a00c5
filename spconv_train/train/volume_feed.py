"""Volumes (``data.kind: volume``) in the trainer: sources, per-rank blocks, validation
items and TensorBoard slices.

The training feed itself is ``data_feed.TrainFeed`` (sample order, resume position, skip
handling are the same for images and volumes); what differs is dispatched here: the block
a rank loads (``load_train_blocks``: the dimension ``parallel.shard_dim`` split like
DTensor's ``Shard``, or for a grid ``parallel.sp: [d, h, w]`` each split dim over its mesh
dim, ``block_bounds``), the DTensor placements (``spatial_placements``) and the panels
logged for validation: the middle slices through the axes that are not split (each rank
cuts its own piece of a slice, rank 0 stitches them).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from spconv_train.config import Config, grid_mesh_dims, spatial_grid, split_dim
from spconv_train.data import (
    AXES,
    Box,
    DataError,
    SyntheticVolumes,
    VolumeAugment,
    VolumeFolder,
    VolumeSource,
    draw_volume_augment,
    load_box,
    make_volume_batch,
    strip_bounds,
)
from spconv_train.train.val_items import ValItem, downsample_strip, make_val_item

__all__ = [
    "block_bounds",
    "load_train_blocks",
    "shard_axis",
    "spatial_dim",
    "spatial_placements",
    "volume_panel_pieces",
    "volume_sources",
    "volume_val_items",
]


def shard_axis(cfg: Config) -> int:
    """The split axis of a volume split along one dim: 0, 1, 2 for D, H, W
    (``parallel.shard_dim``, or the one dim a grid ``[d, h, w]`` splits)."""
    return AXES.index(split_dim(cfg))


def spatial_dim(cfg: Config) -> int:
    """The tensor dimension the sp ranks split along one dim: 3 (W of NCHW) for images,
    ``2 + axis`` for NCDHW volumes."""
    return 2 + shard_axis(cfg) if cfg.data.kind == "volume" else 3


def spatial_placements(cfg: Config, coords) -> list:
    """Placements of a sample on the spatial sub-mesh (``coords``: ``MeshCoords``): image
    strips ``[Shard(3)]``, tiles ``[Shard(2), Shard(3)]``; volumes ``[Shard(2 + axis)]``,
    or one ``Shard`` per mesh dim of a block mesh."""
    if cfg.data.kind != "volume":
        return coords.spatial_placements
    return coords.tile_placements(5) if coords.tiled else [Shard(spatial_dim(cfg))]


def block_bounds(cfg: Config, coords, size: tuple[int, int, int]) -> Box:
    """This rank's ranges ``[a, b)`` along D, H, W of a volume of ``size`` (DTensor's
    chunking along every split dim; the whole extent along the others)."""
    if coords.tiled:
        return (coords.planes(size[0]), coords.rows(size[1]), coords.cols(size[2]))
    axis = shard_axis(cfg)
    return tuple(  # type: ignore[return-value]
        strip_bounds(n, coords.sp, coords.sp_rank) if k == axis else (0, n)
        for k, n in enumerate(size)
    )


def volume_sources(cfg: Config) -> tuple[VolumeSource, VolumeSource]:
    """Train and validation volume sources (folder pairs are checked up front)."""
    d, m = cfg.data, cfg.model
    if d.source == "synthetic":
        kw = dict(
            size=(d.depth, d.height, d.width),
            num_classes=m.num_classes,
            seed=d.synthetic_seed,
            in_channels=m.in_channels,
            ignore_index=d.ignore_index,
        )
        return SyntheticVolumes(d.num_train, **kw), SyntheticVolumes(
            d.num_val, offset=d.num_train, **kw
        )
    kw = dict(
        num_classes=m.num_classes,
        ignore_index=d.ignore_index,
        class_names=d.class_names,
        on_bad_sample=d.on_bad_sample,
    )
    return VolumeFolder(d.root, d.train_split, **kw), VolumeFolder(d.root, d.val_split, **kw)


def load_train_blocks(
    source: VolumeSource, cfg: Config, coords, epoch: int, indices: list[int]
) -> tuple[Tensor, Tensor, tuple[int, int, int]]:
    """This rank's blocks of the volumes ``indices`` augmented for ``epoch``, and the
    global (D, H, W) of the augmented volumes (``load_train_strips`` for volumes)."""
    d = cfg.data
    augments = [
        draw_volume_augment(
            cfg.training.seed,
            epoch,
            i,
            size=source.size(i),
            crop=(d.depth, d.height, d.width),
            hflip=d.hflip,
            vflip=d.vflip,
            name=source.name(i),
        )
        for i in indices
    ]
    size = augments[0].out  # make_volume_batch checks that every volume has it
    image, mask = make_volume_batch(source, indices, augments, block_bounds(cfg, coords, size))
    return image, mask, size


def volume_val_items(
    source: VolumeSource, cfg: Config, coords, sp_mesh: DeviceMesh, device: torch.device
) -> Iterator:
    """Every validation volume once, un-augmented: volume ``i`` on replica ``i % dp``
    (``val_items`` for volumes; ``ValItem.block`` is this rank's box, ``ValItem.cols`` its
    range along the split dim of a one-dim split)."""
    placements = spatial_placements(cfg, coords)
    for index in range(coords.dp_rank, len(source), coords.dp):
        size = source.size(index)
        block = block_bounds(cfg, coords, size)
        cols = block[2] if coords.tiled else block[shard_axis(cfg)]
        try:
            image, mask = load_box(source, index, VolumeAugment.identity(size), block)
        except DataError as e:  # its other ranks may have loaded theirs: validate() agrees
            yield ValItem(index, None, None, cols, None, block, failure=(e.path or "?", e.reason))
            continue
        yield make_val_item(
            index, image, mask, size, sp_mesh, placements, device, cols, None, block
        )


def _cut_axes(cfg: Config) -> list[int]:
    """The axes to slice a volume through for its panels: those not split (each slice then
    holds a piece of every rank), or all three when at most one axis is unsplit."""
    grid = spatial_grid(cfg) if grid_mesh_dims(cfg) else None
    split = [k for k, n in enumerate(grid) if n > 1] if grid else [shard_axis(cfg)]
    whole = [k for k in range(3) if k not in split]
    return whole if len(whole) >= 2 else [0, 1, 2]


def volume_panel_pieces(item, logits, cfg: Config, sp_rank: int) -> list[tuple]:
    """This rank's pieces of the middle slices of a validation volume (``_cut_axes``):
    ``(key, (row, col), None, image, pred, target)`` with image ``[C, r, c]`` and the labels
    ``[r, c]``, downsampled by ``logging.image_downsample`` in global coordinates, keyed by
    the piece's first global (row, column) of the slice (``gather_panels`` stitches them as
    tiles). A rank whose block does not hold the middle slice gives no piece of it."""
    ds, block = cfg.logging.image_downsample, item.block
    size = tuple(item.image.shape[2:])
    volumes = (
        item.image.to_local()[0].float(),  # [C, d, h, w]
        logits.to_local()[0].argmax(0),  # [d, h, w]
        item.target[0],
    )
    pieces = []
    for cut in _cut_axes(cfg):
        middle = size[cut] // 2
        (a, b), (r, c) = block[cut], (block[k][0] for k in range(3) if k != cut)
        if not a <= middle < b:
            continue
        slices = [
            downsample_strip(v.select(v.ndim - 3 + cut, middle - a), c, ds, r).contiguous().cpu()
            for v in volumes
        ]
        pieces.append((f"{item.index}_{AXES[cut]}{middle}", (r, c), None, *slices))
    return pieces
