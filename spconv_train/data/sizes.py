"""The declared size of an image against what one rank may hold: before any allocation.

TIFF and ``.npy`` training crops are read region by region, so a huge file costs only the
crop. An image read *whole* does not: a validation image (validation runs whole images),
or a training image without a crop (``data.height`` / ``data.width`` null), is loaded,
and run through the model, as one piece per spatial rank. A 29 MB tiled TIFF may claim
100000 x 100000 pixels; its pieces would ask for tens of GB on every rank. The header's
size (PNG IHDR, JPEG SOF, TIFF tags, the ``.npy`` header: ``image_header``) is compared
with ``data.max_image_pixels`` per rank, up front.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

from .base import bad_file

__all__ = ["check_piece_size", "piece_size", "warn_crop_larger"]


Crop = tuple[int | None, int | None] | None


def piece_size(size: tuple[int, int], grid: tuple[int, int], crop: Crop) -> tuple[int, int]:
    """``(h, w)`` of the largest piece one rank holds of an image of ``size`` (HxW) split
    into ``grid`` (rows x columns of ranks; strips: ``(1, sp)``), read whole (``crop``
    None: validation) or cropped along the dims where ``crop`` is not None (training)."""
    crop = crop or (None, None)
    extent = [c if c is not None else n for c, n in zip(crop, size, strict=True)]
    return math.ceil(extent[0] / grid[0]), math.ceil(extent[1] / grid[1])


def check_piece_size(
    path: Path,
    size: tuple[int, int],
    *,
    grid: tuple[int, int],
    crop: Crop,
    max_pixels: int,
    what: str,
) -> None:
    """Raise a ``DataError`` naming ``path``, ``data.max_image_pixels`` and the fixes when
    a rank's piece (``piece_size``) of an image of declared ``size`` in split ``what``
    would be over ``max_pixels``. Training images with both crop sizes set pass."""
    if crop is not None and None not in crop:
        return
    h, w = piece_size(size, grid, crop)
    if h * w <= max_pixels:
        return
    ranks = grid[0] * grid[1]
    split = f"{grid[0]}x{grid[1]} tiles" if grid[0] > 1 else f"{ranks} strip(s)"
    fixes = (
        f"remove it from the {what} split (or cut it into smaller images)"
        if crop is None
        else "set data.height and data.width (a training crop)"
    )
    raise bad_file(
        path,
        f"{what} image of {size[0]}x{size[1]} (HxW) is read whole, as {split}: each rank "
        f"would hold {h}x{w} = {h * w:,} pixels, over data.max_image_pixels={max_pixels:,}; "
        f"{fixes}, split it over more ranks (parallel.sp), or raise data.max_image_pixels "
        "if memory allows",
    )


def warn_crop_larger(where: Path, sizes: list[tuple[Path, tuple[int, int]]], crop: Crop) -> None:
    """Warn once, naming both sizes, when the training ``crop`` ``(height, width)`` is
    larger than some of the images ``sizes`` (path, (h, w)) of the split in ``where``:
    the part of a crop outside its image is padded with ``ignore_index`` and trains
    nothing, which a user who set ``data.width`` above the images' width should hear."""
    if crop is None:
        return
    small = [
        (path, size)
        for path, size in sizes
        if any(c is not None and c > n for c, n in zip(crop, size, strict=True))
    ]
    if not small:
        return
    path, (h, w) = small[0]
    ch, cw = ("full" if c is None else c for c in crop)
    warnings.warn(
        f"{where}: the training crop data.height x data.width = {ch} x {cw} is larger than "
        f"{len(small)} of {len(sizes)} image(s) (e.g. {path}: {h} x {w}); the part of a "
        "crop outside its image is padded with ignore_index and trains nothing: lower "
        "data.height / data.width, or use larger images",
        stacklevel=3,
    )
