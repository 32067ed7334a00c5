"""``spconv-train convert``: any supported image -> a tiled, compressed, pyramidal TIFF.

PNG/JPEG cannot be read partially, so every rank decodes them whole; a tiled TIFF is read
tile by tile (each rank only its strip). The pyramid levels (each half the size of the one
before, as SubIFDs of the full-resolution page) are what ``data.level`` selects.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import tifffile

from ._readers import image_header, read_image_raw
from .base import bad_file
from .tiff import is_tiff

__all__ = ["convert_to_tiff", "pyramid_sizes", "source_bands", "write_pyramid"]

_NO_LIMIT = 1 << 62  # converting is the deliberate way past data.max_image_pixels


def _halve(arr: np.ndarray, nearest: bool) -> np.ndarray:
    """``[H, W, C]`` at half resolution (odd sizes round up): 2x2 means for images (the
    last row/column repeated where odd), every other pixel for masks."""
    if nearest:
        return arr[::2, ::2]
    x = np.pad(arr, ((0, arr.shape[0] % 2), (0, arr.shape[1] % 2), (0, 0)), mode="edge")
    # float32 sums four 16-bit values exactly; wider types need float64
    x = x.astype(np.float32 if arr.dtype.itemsize <= 2 else np.float64)
    mean = (x[0::2, 0::2] + x[1::2, 0::2] + x[0::2, 1::2] + x[1::2, 1::2]) / 4
    if np.issubdtype(arr.dtype, np.integer):
        mean = np.rint(mean)
    return mean.astype(arr.dtype)


Band = Callable[[int, int], np.ndarray]  # (r0, r1) -> rows [r1 - r0, W, C] of one level


def source_bands(src: Path, w: int) -> Band:
    """Full-width rows of ``src`` as ``[rows, W, C]``: TIFF and .npy region by region;
    PNG/JPEG (which cannot be read partially) decoded once and sliced."""
    if is_tiff(src) or src.suffix.lower() == ".npy":
        return lambda r0, r1: read_image_raw(src, (0, w), (r0, r1), max_pixels=_NO_LIMIT).transpose(
            1, 2, 0
        )
    whole = read_image_raw(src, (0, w), max_pixels=_NO_LIMIT).transpose(1, 2, 0)
    return lambda r0, r1: whole[r0:r1]


def _tiles(band: Band, h: int, tile: int, planes: int) -> Iterator[np.ndarray]:
    """The tiles of one level in TIFF order (plane, tile row, tile column), one band of
    ``tile`` rows in memory at a time; tifffile pads the edge tiles."""
    for p in range(planes):
        for r0 in range(0, h, tile):
            rows = band(r0, min(r0 + tile, h))
            rows = rows[:, :, p] if planes > 1 else rows
            for c0 in range(0, rows.shape[1], tile):
                yield np.ascontiguousarray(rows[:, c0 : c0 + tile])


def pyramid_sizes(h: int, w: int, stop: int) -> list[tuple[int, int]]:
    """``(H, W)`` of every level: each half the one before (odd sizes round up) until the
    longer side is at most ``stop`` (or a side reaches 1)."""
    sizes = [(h, w)]
    while max(sizes[-1]) > stop and min(sizes[-1]) > 1:
        sizes.append(((sizes[-1][0] + 1) // 2, (sizes[-1][1] + 1) // 2))
    return sizes


def write_pyramid(
    dst: Path,
    band: Band,
    shape: tuple[int, int, int],
    dtype,
    *,
    tile: int = 512,
    compression: str = "zlib",
    min_level_size: int | None = None,
    nearest: bool = False,
    ome: dict | None = None,
    pixel_size: tuple[float, float] | None = None,
) -> list[tuple[int, int]]:
    """Write the ``shape = (H, W, C)`` image whose full-width rows ``band(r0, r1)`` gives
    (``[rows, W, C]``) as a tiled, compressed, pyramidal (Big)TIFF at ``dst``; the levels
    are SubIFDs of the full-resolution page(s), built in temporary memory-mapped files
    next to ``dst`` (memory: a few bands of ``tile`` rows).

    ``nearest`` picks every other pixel (class ids: never averaged); otherwise 2x2 means.
    ``ome``: OME metadata for tifffile (``axes``, ``Channel`` names and colours, ...): the
    file is then an OME-TIFF whose channels are separate pages (a viewer lists them by
    name). ``pixel_size``: ``(x, y)`` in micrometres, written per level as resolution
    tags (and ``PhysicalSizeX/Y`` with ``ome``); None leaves them unset (unit NONE).
    Returns ``(H, W)`` of every level, full resolution first."""
    h, w, channels = shape
    dtype = np.dtype(dtype)
    sizes = pyramid_sizes(h, w, tile if min_level_size is None else min_level_size)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if ome is not None and pixel_size is not None:
        ome = {**ome, "PhysicalSizeX": pixel_size[0], "PhysicalSizeXUnit": "µm"}
        ome.update(PhysicalSizeY=pixel_size[1], PhysicalSizeYUnit="µm")
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".convert-") as tmp:
        bands = [band]
        for k in range(1, len(sizes)):  # level k from level k-1, tile (even) rows at a time
            (ph, _), (lh, lw) = sizes[k - 1], sizes[k]
            level = np.lib.format.open_memmap(
                Path(tmp) / f"level{k}.npy", mode="w+", dtype=dtype, shape=(lh, lw, channels)
            )
            for r0 in range(0, ph, tile):
                rows = bands[k - 1](r0, min(r0 + tile, ph))
                level[r0 // 2 : (r0 + tile) // 2] = _halve(rows, nearest)
            level.flush()
            bands.append(lambda r0, r1, level=level: level[r0:r1])
        photometric = "rgb" if channels in (3, 4) and dtype == np.uint8 else "minisblack"
        if ome is not None:
            photometric = "minisblack"  # class maps and probabilities, never colour pictures
        planes = photometric == "minisblack" and channels > 1  # any channel count
        big = h * w * channels * dtype.itemsize > 2**31  # classic TIFF offsets end at 4 GB
        with tifffile.TiffWriter(dst, bigtiff=big, ome=ome is not None) as tif:
            for k, (lh, lw) in enumerate(sizes):
                shape = (channels, lh, lw) if planes else (lh, lw, channels)
                scale = (w / lw, h / lh)  # this level's pixel size over the full level's
                tif.write(
                    _tiles(bands[k], lh, tile, channels if planes else 1),
                    shape=shape if channels > 1 else (lh, lw),
                    dtype=dtype,
                    tile=(tile, tile),
                    compression=None if compression == "none" else compression,
                    photometric=photometric,
                    # OME: one page per channel; plain TIFF: one page, planes as samples
                    planarconfig="separate" if planes and ome is None else None,
                    subifds=len(sizes) - 1 if k == 0 else None,
                    subfiletype=1 if k else 0,
                    metadata=ome if k == 0 else None,
                    **_resolution(pixel_size, scale),
                )
    return sizes


def _resolution(pixel_size: tuple[float, float] | None, scale: tuple[float, float]) -> dict:
    """tifffile's resolution arguments (pixels per cm) for a pixel size in micrometres."""
    if pixel_size is None:
        return {}
    x, y = (1e4 / (p * s) for p, s in zip(pixel_size, scale, strict=True))
    return {"resolution": (x, y), "resolutionunit": "CENTIMETER"}


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

    TIFF and .npy inputs are streamed (memory: a few bands of ``tile`` rows; the reduced
    levels are built in temporary memory-mapped files next to ``dst``); PNG/JPEG are
    decoded whole, as they must be.

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
    h, w, channels = image_header(src, max_pixels=_NO_LIMIT)
    band = source_bands(src, w)
    dtype = band(0, min(1, h)).dtype
    return write_pyramid(
        dst,
        band,
        (h, w, channels),
        dtype,
        tile=tile,
        compression=compression,
        min_level_size=min_level_size,
        nearest=nearest,
    )
