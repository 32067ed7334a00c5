"""Tile-aware TIFF reads with ``tifffile`` (+ ``imagecodecs`` for compressed segments).

TIFF, BigTIFF, OME-TIFF and the whole-slide formats ``tifffile`` reads (SVS, ...), tiled or
stripped, any compression ``tifffile`` decodes. ``read_region`` decodes only the tiles or
strips that intersect the requested rows and columns, so a rank reading its column strip
of a crop pays for the crop's tiles, not for the file. Pyramidal files: ``level`` picks a
level of the first series (0 = full resolution; OME-TIFF sub-IFDs and SVS reduced
images are levels as ``tifffile`` reports them).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import tifffile

from .base import DataError, bad_file

__all__ = ["TIFF_EXTS", "is_tiff", "needs_color_conversion", "read_region", "tiff_header"]

TIFF_EXTS = frozenset({".tif", ".tiff", ".btf", ".svs"})
# Palette, CMYK and Lab images are converted to RGB (by Pillow, decoding them whole).
_CONVERTED_PHOTOMETRIC = frozenset({3, 5, 8, 9, 10})
_ERRORS = (OSError, ValueError, KeyError, IndexError, NotImplementedError, tifffile.TiffFileError)


def is_tiff(path: Path) -> bool:
    """Whether ``path`` is read by this module (by extension)."""
    return Path(path).suffix.lower() in TIFF_EXTS


def _level_pages(tif: tifffile.TiffFile, path: Path, level: int) -> list:
    """The pages (one per plane) of pyramid ``level`` of the first series."""
    if not tif.series:
        raise bad_file(path, "TIFF holds no image series")
    series = tif.series[0]
    levels = series.levels
    if not 0 <= level < len(levels):
        raise bad_file(
            path,
            f"data.level={level} but the file has {len(levels)} level(s) (0..{len(levels) - 1})",
        )
    pages = [p for p in levels[level].pages if p is not None]
    if not pages:
        raise bad_file(path, f"level {level} holds no pages")
    key = pages[0].keyframe
    if key.imagedepth > 1:
        raise bad_file(path, "volumetric (depth > 1) TIFF pages are not supported")
    return pages


def _samples(key) -> int:
    return int(key.samplesperpixel) if key.samplesperpixel > 1 else 1


def tiff_header(path: Path, level: int = 0) -> tuple[int, int, int, np.dtype]:
    """``(H, W, C, dtype)`` of ``level``, from the tags only (nothing is decoded).

    Several pages in one level (e.g. an OME-TIFF stored plane by plane) are channels.
    """
    try:
        with tifffile.TiffFile(path) as tif:
            pages = _level_pages(tif, path, level)
            key = pages[0].keyframe
            return (
                int(key.imagelength),
                int(key.imagewidth),
                _samples(key) * len(pages),
                np.dtype(key.dtype),
            )
    except DataError:
        raise
    except _ERRORS as e:
        raise bad_file(path, f"cannot read TIFF ({type(e).__name__}: {e})") from e


def needs_color_conversion(path: Path, level: int = 0) -> bool:
    """Whether an *image* TIFF stores palette/CMYK/Lab colours (read through Pillow as RGB,
    like PNG). Masks never are: a palette mask's indices are its class indices."""
    try:
        with tifffile.TiffFile(path) as tif:
            return int(_level_pages(tif, path, level)[0].keyframe.photometric) in (
                _CONVERTED_PHOTOMETRIC
            )
    except DataError:
        raise
    except _ERRORS as e:
        raise bad_file(path, f"cannot read TIFF ({type(e).__name__}: {e})") from e


def _decode_segment(page, data: bytes | None, index: int):
    """Decode one tile or strip (``tifffile``'s codec pipeline); tests count calls here."""
    key = page.keyframe
    kwargs = {}
    if key.compression in {6, 7, 34892, 33007}:  # JPEG flavours need their tables
        kwargs = {"jpegtables": page.jpegtables, "jpegheader": key.jpegheader}
    return key.decode(data, index, _fullsize=False, **kwargs)


def _segment_grid(key) -> tuple[int, int, int, int, int]:
    """``(planes, segment_rows, segment_cols, rows_per_segment, cols_per_segment)``."""
    planes = _samples(key) if key.planarconfig == 2 else 1
    if key.is_tiled:
        th, tw = int(key.tilelength), int(key.tilewidth)
    else:
        th, tw = int(key.rowsperstrip), int(key.imagewidth)
        th = min(max(th, 1), int(key.imagelength))
    return (
        planes,
        math.ceil(key.imagelength / th),
        math.ceil(key.imagewidth / tw),
        th,
        tw,
    )


def _read_page(page, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Rows x columns of one page as ``[h, w, samples]``, decoding intersecting segments."""
    key = page.keyframe
    (r0, r1), (c0, c1) = rows, cols
    samples = _samples(key)
    out = np.full((r1 - r0, c1 - c0, samples), key.nodata, dtype=key.dtype)
    if r0 == r1 or c0 == c1:
        return out
    planes, ny, nx, th, tw = _segment_grid(key)
    fh = page.parent.filehandle
    offsets, counts = page.dataoffsets, page.databytecounts
    for plane in range(planes):
        for iy in range(r0 // th, (r1 - 1) // th + 1):
            for ix in range(c0 // tw, (c1 - 1) // tw + 1):
                index = (plane * ny + iy) * nx + ix
                data = None
                if counts[index] > 0:
                    with fh.lock:
                        fh.seek(offsets[index])
                        data = fh.read(counts[index])
                segment, (_, _, y, x, _), _ = _decode_segment(page, data, index)
                if segment is None:
                    continue  # empty segment: keep nodata
                seg = segment[0]  # drop depth: [h, w, contig samples]
                seg = seg[: key.imagelength - y, : key.imagewidth - x]
                ya, yb = max(r0, y), min(r1, y + seg.shape[0])
                xa, xb = max(c0, x), min(c1, x + seg.shape[1])
                if ya >= yb or xa >= xb:
                    continue
                part = seg[ya - y : yb - y, xa - x : xb - x]
                if planes > 1:
                    out[ya - r0 : yb - r0, xa - c0 : xb - c0, plane] = part[..., 0]
                else:
                    out[ya - r0 : yb - r0, xa - c0 : xb - c0] = part.reshape(
                        yb - ya, xb - xa, samples
                    )
    return out


def read_region(
    path: str | Path,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
    level: int = 0,
) -> np.ndarray:
    """Rows ``[r0, r1)`` x columns ``[c0, c1)`` of a TIFF level in the file's dtype.

    Only the tiles or strips intersecting the region are read and decoded.

    Args:
        path: the TIFF file.
        rows, cols: half-open ranges (None = all).
        level: pyramid level of the first series (0 = full resolution).

    Returns:
        ``[h, w]`` for single-channel images, else ``[h, w, C]``.

    Raises:
        DataError: naming the file, for unreadable files, bad ranges or a missing level.
    """
    path = Path(path)
    try:
        with tifffile.TiffFile(path) as tif:
            pages = _level_pages(tif, path, level)
            key = pages[0].keyframe
            h, w = int(key.imagelength), int(key.imagewidth)
            r0, r1 = (0, h) if rows is None else (int(rows[0]), int(rows[1]))
            c0, c1 = (0, w) if cols is None else (int(cols[0]), int(cols[1]))
            if not (0 <= r0 <= r1 <= h and 0 <= c0 <= c1 <= w):
                raise bad_file(
                    path, f"region rows [{r0}, {r1}) x cols [{c0}, {c1}) is outside {h}x{w}"
                )
            parts = [_read_page(p, (r0, r1), (c0, c1)) for p in pages]
    except DataError:
        raise
    except _ERRORS as e:
        raise bad_file(path, f"cannot decode TIFF ({type(e).__name__}: {e})") from e
    out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)
    return out[:, :, 0] if out.shape[2] == 1 else out
