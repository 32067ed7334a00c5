"""Validation panels for TensorBoard: each rank cuts its downsampled piece of a panel
(an image's strip, or the middle slices of a volume's block), rank 0 stitches them.

Only small downsampled pieces travel (one ``gather_object``), never a whole activation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spconv_train.config import Config
from spconv_train.train.data_feed import ValItem, downsample_strip
from spconv_train.train.volume_feed import volume_panel_pieces

__all__ = ["gather_panels", "panel_pieces"]


def panel_pieces(item: ValItem, logits, cfg: Config, sp_rank: int) -> list[tuple]:
    """This rank's downsampled pieces ``(key, sp_rank, stitch_dim, image, pred, target)``
    of the validation panels of ``item`` for ``gather_panels`` (a volume gives its middle
    slices: ``volume_panel_pieces``)."""
    if cfg.data.kind == "volume":
        return volume_panel_pieces(item, logits, cfg, sp_rank)
    a, ds = item.cols[0], cfg.logging.image_downsample
    small = [
        downsample_strip(t, a, ds).cpu()
        for t in (item.image.to_local()[0].float(), logits.to_local()[0].argmax(0), item.target[0])
    ]
    return [(item.index, sp_rank, -1, *small)]


def gather_panels(pieces: list) -> dict:
    """Collect on rank 0 the downsampled pieces ``(key, sp_rank, stitch_dim, image, pred,
    target)`` of every rank (collective) and stitch them along ``stitch_dim`` (the width of
    an image), in sp-rank order.

    Returns ``{key: (image CHW, pred HW, target HW)}`` on rank 0, ``{}`` elsewhere.
    """
    rank0 = dist.get_rank() == 0
    gathered = [None] * dist.get_world_size() if rank0 else None
    dist.gather_object(pieces, gathered, dst=0)
    parts: dict[int, list] = {}
    for rank_pieces in gathered or []:
        for key, sp_rank, dim, *tensors in rank_pieces:
            parts.setdefault(key, []).append((sp_rank, dim, tensors))
    return {
        key: tuple(
            torch.cat([t[i] for _, _, t in sorted(p, key=lambda q: q[0])], dim=p[0][1])
            for i in range(3)
        )
        for key, p in sorted(parts.items())
    }
