"""``spconv-train convert``: any supported image -> a tiled, compressed, pyramidal TIFF.

PNG/JPEG cannot be read partially, so every rank decodes them whole; a tiled TIFF is read
tile by tile (each rank only its strip). The pyramid levels (each half the size of the one
before, as SubIFDs of the full-resolution page) are what ``data.level`` selects.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tifffile

from ._readers import image_header, read_image_raw
from .base import bad_file

__all__ = ["convert_to_tiff"]

_NO_LIMIT = 1 << 62  # converting is the deliberate way past data.max_image_pixels


def _halve(arr: np.ndarray, nearest: bool) -> np.ndarray:
    """``[H, W, C]`` at half resolution (odd sizes round up): 2x2 means for images (the
    last row/column repeated where odd), every other pixel for masks."""
    if nearest:
        return arr[::2, ::2]
    x = np.pad(arr, ((0, arr.shape[0] % 2), (0, arr.shape[1] % 2), (0, 0)), mode="edge")
    x = x.astype(np.float64)
    mean = (x[0::2, 0::2] + x[1::2, 0::2] + x[0::2, 1::2] + x[1::2, 1::2]) / 4
    if np.issubdtype(arr.dtype, np.integer):
        mean = np.rint(mean)
    return mean.astype(arr.dtype)


def convert_to_tiff(
    src: str | Path,
    dst: str | Path,
    *,
    tile: int = 512,
    compression: str = "zlib",
    min_level_size: int | None = None,
    nearest: bool = False,
) -> list[tuple[int, int]]:
    """Write ``src`` as a tiled, compressed, pyramidal (Big)TIFF at ``dst``.

    Args:
        src: any image the readers support (PNG, JPEG, TIFF, .npy).
        dst: output path (.tif).
        tile: tile edge in pixels (a multiple of 16).
        compression: ``zlib``, ``zstd``, ``lzw`` or ``none``.
        min_level_size: stop halving once the longer side is at most this (default: tile).
        nearest: downsample levels by picking pixels (for masks) instead of 2x2 means.

    Returns:
        ``(H, W)`` of every level written, full resolution first.
    """
    src, dst = Path(src), Path(dst)
    if tile < 16 or tile % 16:
        raise ValueError(f"tile must be a positive multiple of 16, got {tile}")
    if src.resolve() == dst.resolve():
        raise bad_file(dst, "output must differ from the input file")
    h, w, _ = image_header(src, max_pixels=_NO_LIMIT)
    raw = read_image_raw(src, (0, w), max_pixels=_NO_LIMIT)  # [C, H, W] in its dtype
    level = np.ascontiguousarray(raw.transpose(1, 2, 0))
    stop = tile if min_level_size is None else min_level_size
    sizes = [(h, w)]
    while max(sizes[-1]) > stop and min(sizes[-1]) > 1:
        sizes.append(((sizes[-1][0] + 1) // 2, (sizes[-1][1] + 1) // 2))
    channels = level.shape[2]
    photometric = "rgb" if channels in (3, 4) and level.dtype == np.uint8 else "minisblack"
    comp = None if compression == "none" else compression
    separate = photometric == "minisblack" and channels > 1  # planar: any channel count
    big = raw.nbytes > 2**31  # classic TIFF offsets end at 4 GB; keep headroom
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tifffile.TiffWriter(dst, bigtiff=big) as tif:
        for i in range(len(sizes)):
            if i:
                level = _halve(level, nearest)
            data = level[:, :, 0] if channels == 1 else level
            if separate:
                data = np.ascontiguousarray(level.transpose(2, 0, 1))
            tif.write(
                data,
                tile=(tile, tile),
                compression=comp,
                photometric=photometric,
                planarconfig="separate" if separate else None,
                subifds=len(sizes) - 1 if i == 0 else None,
                subfiletype=1 if i else 0,
                metadata=None,
            )
    return sizes
