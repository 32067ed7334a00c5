"""One validation image (or volume) on this rank: ``ValItem``, made from a loaded piece by
``make_val_item`` without communication, and ``downsample_strip`` for its panels. Shared by
the image feed (``data_feed.val_items``) and the volume feed (``volume_feed``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from spconv_train.train.mesh_coords import to_dtensor

__all__ = ["ValItem", "downsample_strip", "make_val_item"]


@dataclass
class ValItem:
    """One validation image on this rank (a batch of one per data-parallel replica)."""

    index: int  # sample index in the val source
    image: DTensor | None  # [1, C, H, W] on the sp sub-mesh, Shard(3) (tiles: Shard(2), Shard(3))
    target: Tensor | None  # local mask strip [1, H, w] (tiles: [1, h, w])
    cols: tuple[int, int]  # this rank's global columns [a, b) (volumes: along the split dim)
    rows: tuple[int, int] | None = None  # tiles: this rank's global rows [r, s)
    block: tuple | None = None  # volumes: this rank's ((D), (H), (W)) ranges [a, b)
    failure: tuple[str, str] | None = None  # (file, reason) when this rank cannot load it


def make_val_item(
    index: int,
    image: Tensor,
    mask: Tensor,
    size: tuple[int, ...],
    sp_mesh: DeviceMesh,
    placements: list,
    device: torch.device,
    *where,
) -> ValItem:
    """This rank's piece ``image`` ``[C, ...]`` / ``mask`` of validation sample ``index``
    (global spatial ``size``) as a ``ValItem`` (a DTensor on ``sp_mesh``, no communication);
    ``where``: the piece's ``cols, rows, block``."""
    shape = (1, image.shape[0], *size)
    x = to_dtensor(image[None].to(device), sp_mesh, placements, shape)
    return ValItem(index, x, mask[None].to(device), *where)


def downsample_strip(t: Tensor, col_start: int, factor: int, row_start: int = 0) -> Tensor:
    """Keep the GLOBAL rows and columns ``0, f, 2f, ...`` of a strip (or tile) that starts at
    global column ``col_start`` (and row ``row_start``): concatenating the pieces of all
    ranks gives exactly ``full[..., ::f, ::f]``, so only small tensors ever travel."""
    return t[..., (-row_start) % factor :: factor, (-col_start) % factor :: factor]
