"""Validation panels for TensorBoard: each rank cuts its downsampled piece of a panel
(an image's strip, or the middle slices of a volume's block), rank 0 stitches them.

Only small downsampled pieces travel (one ``gather_object``), never a whole activation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spconv_train.config import Config
from spconv_train.data import stitch_grid
from spconv_train.train.val_items import ValItem, downsample_strip
from spconv_train.train.volume_feed import volume_panel_pieces

__all__ = ["gather_panels", "panel_pieces"]


def panel_pieces(item: ValItem, logits, cfg: Config, sp_rank: int) -> list[tuple]:
    """This rank's downsampled pieces ``(key, sp_rank, stitch_dim, image, pred, target)``
    of the validation panels of ``item`` for ``gather_panels`` (a volume gives its middle
    slices: ``volume_panel_pieces``)."""
    if cfg.data.kind == "volume":
        return volume_panel_pieces(item, logits, cfg, sp_rank)
    a, ds = item.cols[0], cfg.logging.image_downsample
    r = item.rows[0] if item.rows is not None else 0
    small = [
        downsample_strip(t, a, ds, r).cpu()
        for t in (item.image.to_local()[0].float(), logits.to_local()[0].argmax(0), item.target[0])
    ]
    if item.rows is not None:  # a tile: stitched by its (first row, first column)
        return [(item.index, (r, a), None, *small)]
    return [(item.index, sp_rank, -1, *small)]


def _stitch(parts: list, i: int) -> torch.Tensor:
    """Tensor ``i`` of the pieces ``(order, dim, tensors)`` of one panel, stitched: along
    ``dim`` in order, or (``dim`` None: tiles keyed by their first (row, column)) as a grid
    of tiles (sorting the keys lists the tiles row by row)."""
    parts = sorted(parts, key=lambda q: q[0])
    pieces = [t[i] for _, _, t in parts]
    if parts[0][1] is not None:
        return stitch_grid(pieces, (len(pieces),), (parts[0][1],))
    rows = len({r for (r, _), _, _ in parts})
    return stitch_grid(pieces, (rows, len(pieces) // rows), (-2, -1))


def gather_panels(pieces: list) -> dict:
    """Collect on rank 0 the downsampled pieces ``(key, sp_rank, stitch_dim, image, pred,
    target)`` of every rank (collective) and stitch them along ``stitch_dim`` (the width of
    an image), in sp-rank order (tiles: ``stitch_dim`` None, ``sp_rank`` the tile's first
    (row, column), stitched in two dims).

    Returns ``{key: (image CHW, pred HW, target HW)}`` on rank 0, ``{}`` elsewhere.
    """
    rank0 = dist.get_rank() == 0
    gathered = [None] * dist.get_world_size() if rank0 else None
    dist.gather_object(pieces, gathered, dst=0)
    parts: dict[int, list] = {}
    for rank_pieces in gathered or []:
        for key, sp_rank, dim, *tensors in rank_pieces:
            parts.setdefault(key, []).append((sp_rank, dim, tensors))
    return {key: tuple(_stitch(p, i) for i in range(3)) for key, p in sorted(parts.items())}
