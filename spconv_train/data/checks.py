"""Up-front integrity checks of image files: cheap where the format allows it.

``verify_image`` (PIL ``verify``) checks PNG chunk CRCs and truncation, and ``.npy`` headers
against the file size, but decodes nothing: a truncated JPEG or TIFF passes it and fails
only when a rank decodes it in the middle of training. ``check_decodable`` adds the
missing checks without decoding whole files where it can:

- JPEG: a complete file ends with the end-of-image marker ``FF D9`` (two bytes read at
  the end); only a file without it (truncated, or with trailing bytes) is decoded fully
  to decide.
- TIFF: every strip or tile that the header points at must lie inside the file (header
  only, through ``tifffile``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ._readers import _READ_ERRORS, DEFAULT_MAX_PIXELS, _open_pil, _pil_limit_lifted, verify_image
from .base import bad_file

__all__ = ["check_decodable"]

_JPEG_EXTS = frozenset({".jpg", ".jpeg"})
_TIFF_EXTS = frozenset({".tif", ".tiff"})
_JPEG_EOI = b"\xff\xd9"


def _jpeg_ends_cleanly(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 4:
            return False
        f.seek(-2, os.SEEK_END)
        return f.read(2) == _JPEG_EOI


def _decode_fully(path: Path, max_pixels: int) -> None:
    try:
        with _open_pil(path, max_pixels) as img, _pil_limit_lifted():
            img.load()
    except _READ_ERRORS as e:
        raise bad_file(path, f"corrupt or truncated image ({type(e).__name__}: {e})") from e


def _check_tiff_extent(path: Path) -> None:
    import tifffile

    size = path.stat().st_size
    try:
        with tifffile.TiffFile(path) as tif:
            for index, page in enumerate(tif.pages):
                for offset, count in zip(page.dataoffsets, page.databytecounts, strict=False):
                    if offset + count > size:
                        raise bad_file(
                            path,
                            f"truncated TIFF: page {index} has data up to byte "
                            f"{offset + count:,} but the file has {size:,} bytes",
                        )
    except (tifffile.TiffFileError, *_READ_ERRORS) as e:
        raise bad_file(path, f"corrupt TIFF ({type(e).__name__}: {e})") from e


def check_decodable(path: Path, *, level: int = 0, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Raise a ``DataError`` naming ``path`` if the image file is corrupt or truncated.

    Cheap for every format (headers, chunk checksums, the last two bytes of a JPEG); a
    JPEG is decoded fully only when it does not end with its end-of-image marker.
    """
    path = Path(path)
    verify_image(path, level=level, max_pixels=max_pixels)
    suffix = path.suffix.lower()
    if suffix in _JPEG_EXTS and not _jpeg_ends_cleanly(path):
        _decode_fully(path, max_pixels)
    elif suffix in _TIFF_EXTS:
        _check_tiff_extent(path)
