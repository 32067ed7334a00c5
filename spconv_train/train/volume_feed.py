"""Volumes (``data.kind: volume``) in the trainer: sources, per-rank blocks, validation
items and TensorBoard slices.

The training feed itself is ``data_feed.TrainFeed`` (sample order, resume position, skip
handling are the same for images and volumes); what differs is dispatched here: the block
a rank loads (``load_train_blocks``, the dimension ``parallel.shard_dim`` split like
DTensor's ``Shard``), the DTensor placement (``Shard(2 + axis)``) and the panels logged for
validation: the middle slices through the two axes that are not split (each rank cuts its
own block of the slice, rank 0 stitches them along the split axis).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from spconv_train.config import Config, ConfigError
from spconv_train.data import (
    AXES,
    SyntheticVolumes,
    VolumeAugment,
    VolumeFolder,
    VolumeSource,
    draw_volume_augment,
    load_block,
    make_volume_batch,
    strip_bounds,
)

__all__ = [
    "check_model_dims",
    "load_train_blocks",
    "shard_axis",
    "spatial_dim",
    "volume_panel_pieces",
    "volume_sources",
    "volume_val_items",
]


def shard_axis(cfg: Config) -> int:
    """The split axis of a volume: 0, 1, 2 for ``parallel.shard_dim`` D, H, W."""
    return AXES.index(cfg.parallel.shard_dim)


def spatial_dim(cfg: Config) -> int:
    """The tensor dimension the sp ranks split: 3 (W of NCHW) for images, ``2 + axis``
    for NCDHW volumes."""
    return 2 + shard_axis(cfg) if cfg.data.kind == "volume" else 3


def check_model_dims(cfg: Config, model) -> None:
    """A 3-D model (``spatial_dims = 3``, e.g. ``unet3d``) for volumes, a 2-D one for images;
    otherwise ``ConfigError`` before anything runs. Models without the attribute are 2-D."""
    dims = getattr(model, "spatial_dims", 2)
    if cfg.data.kind == "volume" and dims != 3:
        raise ConfigError(
            "model.name",
            f"{cfg.model.name} is a 2-D model but data.kind is volume; use a 3-D model "
            "such as unet3d",
        )
    if cfg.data.kind == "image" and dims == 3:
        raise ConfigError(
            "data.kind",
            f"is image but {cfg.model.name} is a 3-D model; set data.kind: volume",
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
    axis, size = shard_axis(cfg), augments[0].out
    bounds = strip_bounds(size[axis], coords.sp, coords.sp_rank)
    image, mask = make_volume_batch(source, indices, augments, axis, bounds)
    return image, mask, size


def volume_val_items(
    source: VolumeSource, cfg: Config, coords, sp_mesh: DeviceMesh, device: torch.device
) -> Iterator:
    """Every validation volume once, un-augmented: volume ``i`` on replica ``i % dp``
    (``val_items`` for volumes; ``ValItem.cols`` is the block along the split axis)."""
    from spconv_train.train.data_feed import ValItem, to_dtensor  # noqa: PLC0415 (cycle)

    axis = shard_axis(cfg)
    for index in range(coords.dp_rank, len(source), coords.dp):
        size = source.size(index)
        bounds = strip_bounds(size[axis], coords.sp, coords.sp_rank)
        image, mask = load_block(source, index, VolumeAugment.identity(size), axis, bounds)
        shape = (1, image.shape[0], *size)
        x = to_dtensor(image[None].to(device), sp_mesh, [Shard(2 + axis)], shape)
        yield ValItem(index, x, mask[None].to(device), bounds)


def volume_panel_pieces(item, logits, cfg: Config, sp_rank: int) -> list[tuple]:
    """This rank's pieces of the middle slices of a validation volume through the axes
    that are not split: ``(key, sp_rank, stitch_dim, image, pred, target)`` with image
    ``[C, r, c]`` and the labels ``[r, c]``, downsampled by ``logging.image_downsample`` in
    global coordinates (``gather_panels`` stitches them along ``stitch_dim``)."""
    from spconv_train.train.data_feed import downsample_strip  # noqa: PLC0415 (cycle)

    axis, ds, a = shard_axis(cfg), cfg.logging.image_downsample, item.cols[0]
    size = tuple(item.image.shape[2:])
    volumes = (
        item.image.to_local()[0].float(),  # [C, d, h, w]
        logits.to_local()[0].argmax(0),  # [d, h, w]
        item.target[0],
    )
    pieces = []
    for cut in (k for k in range(3) if k != axis):
        middle = size[cut] // 2
        # Without the cut axis, the split axis is the slice's columns (the later of the
        # two remaining axes) or its rows.
        stitch = -1 if axis == max(k for k in range(3) if k != cut) else -2
        slices = []
        for v in volumes:
            plane = v.select(v.ndim - 3 + cut, middle)
            if stitch == -2:  # downsample the split rows in global coordinates
                plane = downsample_strip(plane.transpose(-1, -2), a, ds).transpose(-1, -2)
            else:
                plane = downsample_strip(plane, a, ds)
            slices.append(plane.contiguous().cpu())
        key = f"{item.index}_{AXES[cut]}{middle}"
        pieces.append((key, sp_rank, stitch, *slices))
    return pieces
