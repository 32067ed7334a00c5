"""Low-level image and mask readers: headers without decoding, and region reads.

Every failure is a ``DataError`` naming the file. Supported:
- images: TIFF / BigTIFF / OME-TIFF / SVS (``tifffile``, tile by tile, pyramid ``level``),
  PNG and JPEG (Pillow, decoded whole up to ``max_pixels``) and ``.npy`` (``[H, W]``,
  ``[C, H, W]`` or ``[H, W, C]``; the channel axis is the shorter of the first and last
  axes, ``[C, H, W]`` on a tie, read through a memory map).
- masks: PNG, TIFF and ``.npy`` (``[H, W]`` integer, or a singleton channel axis); values
  are class indices (a palette PNG/TIFF gives its palette indices).

``read_image_raw`` returns pixels in the file's dtype; ``read_image`` applies today's
default normalisation (``dtype``: uint8 / 255, uint16 / 65535, floats kept).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from .base import DataError, bad_file
from .normalize import scale_by_dtype
from .tiff import TIFF_EXTS, is_tiff, needs_color_conversion, read_region, tiff_header

IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".npy"}) | TIFF_EXTS
MASK_EXTS = frozenset({".png", ".npy"}) | TIFF_EXTS
DEFAULT_MAX_PIXELS = 2_000_000_000  # data.max_image_pixels
_READ_ERRORS = (OSError, ValueError, SyntaxError, UnidentifiedImageError, EOFError)
_MULTI_BAND = {"P": 3, "CMYK": 3, "YCbCr": 3, "LAB": 3, "HSV": 3}  # converted to RGB on read
_RGB_MASK_HINT = (
    "masks must hold one class index per pixel; convert the colours to class indices "
    "(e.g. an 'L' or palette 'P' PNG via a colour-to-index table)"
)
Rows = tuple[int, int] | None


def _is_npy(path: Path) -> bool:
    return path.suffix.lower() == ".npy"


@contextmanager
def _pil_limit_lifted():
    """Pillow's decompression-bomb guard off: ``_open_pil`` applies ``max_pixels`` itself,
    naming the file and the fix instead of a traceback on every rank."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _open_pil(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open lazily (header only) and refuse images over ``max_pixels`` with the fix."""
    try:
        with _pil_limit_lifted():
            img = Image.open(path)
    except _READ_ERRORS as e:
        raise bad_file(path, f"cannot read ({type(e).__name__}: {e})") from e
    w, h = img.size
    if w * h > max_pixels:
        img.close()
        raise bad_file(
            path,
            f"{h}x{w} = {w * h:,} pixels is over data.max_image_pixels={max_pixels:,} "
            f"({path.suffix or 'this format'} files are decoded whole on every rank); convert "
            f"it to a tiled TIFF, read tile by tile: spconv-train convert {path} "
            f"{path.with_suffix('.tif')} (then move the original out of the folder), or raise "
            "data.max_image_pixels if memory allows",
        )
    return img


def _open_npy(path: Path) -> np.ndarray:
    try:
        # mmap: shape from the header, and later only the requested columns are read.
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except _READ_ERRORS as e:
        raise bad_file(path, f"cannot read ({type(e).__name__}: {e})") from e


def _npy_layout(shape: tuple[int, ...], path: Path) -> str:
    """``"hw"``, ``"chw"`` or ``"hwc"`` for an image array of ``shape``."""
    if len(shape) == 2:
        return "hw"
    if len(shape) == 3:
        return "chw" if shape[0] <= shape[2] else "hwc"
    raise bad_file(path, f"array of shape {tuple(shape)} is not [H,W], [C,H,W] or [H,W,C]")


def _tiled_read(path: Path, level: int) -> bool:
    """Image TIFFs go through ``tifffile`` (tile by tile) unless their colours need a
    conversion to RGB (palette, CMYK, Lab: rare, small, decoded whole by Pillow)."""
    return is_tiff(path) and (level > 0 or not needs_color_conversion(path))


def image_header(
    path: Path, *, level: int = 0, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[int, int, int]:
    """``(H, W, C)`` of an image file, without decoding its pixels."""
    if _is_npy(path):
        shape = _open_npy(path).shape
        layout = _npy_layout(shape, path)
        if layout == "hw":
            return shape[0], shape[1], 1
        return (shape[1], shape[2], shape[0]) if layout == "chw" else (shape[0], shape[1], shape[2])
    if _tiled_read(path, level):
        return tiff_header(path, level)[:3]
    with _open_pil(path, max_pixels) as img:
        w, h = img.size
        return h, w, _MULTI_BAND.get(img.mode, len(img.getbands()))


def mask_header(
    path: Path, *, level: int = 0, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[int, int, int]:
    """``(H, W, channels)`` of a mask file, without decoding its pixels."""
    if _is_npy(path):
        shape = _open_npy(path).shape
        if len(shape) == 2:
            return shape[0], shape[1], 1
        if len(shape) == 3 and 1 in (shape[0], shape[2]):
            return (shape[1], shape[2], 1) if shape[0] == 1 else (shape[0], shape[1], 1)
        if len(shape) == 3:
            c_first = shape[0] <= shape[2]
            return (shape[1], shape[2], shape[0]) if c_first else (shape[0], shape[1], shape[2])
        raise bad_file(path, f"mask array of shape {tuple(shape)} is not [H, W]")
    if is_tiff(path):
        return tiff_header(path, level)[:3]
    with _open_pil(path, max_pixels) as img:
        w, h = img.size
        return h, w, 1 if img.mode == "P" else len(img.getbands())


def verify_image(path: Path, *, level: int = 0, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Cheap integrity check without decoding (PIL ``verify``; TIFF/npy: the header)."""
    if _is_npy(path):
        _open_npy(path)
        return
    if is_tiff(path):
        tiff_header(path, level)
        return
    try:
        with _open_pil(path, max_pixels) as img, _pil_limit_lifted():
            img.verify()
    except _READ_ERRORS as e:
        raise bad_file(path, f"corrupt or truncated image ({type(e).__name__}: {e})") from e


def _decode_pil(
    path: Path, cols: tuple[int, int], rows: Rows, image: bool, max_pixels: int
) -> tuple[np.ndarray, str]:
    """Pixels of rows x columns ``[a, b)`` and the PIL mode; decoded whole, then cropped.

    For images, palette/CMYK/... modes are converted to RGB and '1' to 'L'; masks are
    returned as stored (a 'P' mask gives its palette indices, which are the class indices).
    """
    a, b = cols
    try:
        with _open_pil(path, max_pixels) as img, _pil_limit_lifted():
            r0, r1 = (0, img.size[1]) if rows is None else rows
            box = (a, r0, b, r1)
            part = img.crop(box) if box != (0, 0, *img.size) else img
            part.load()
            mode = part.mode
            if image and mode == "1":
                part, mode = part.convert("L"), "L"
            elif image and mode in _MULTI_BAND:
                part, mode = part.convert("RGB"), "RGB"
            # Convert before the file closes: closing destroys the decoded image.
            return np.array(part), mode
    except _READ_ERRORS as e:
        raise bad_file(path, f"cannot decode ({type(e).__name__}: {e})") from e


def read_image_raw(
    path: Path,
    cols: tuple[int, int],
    rows: Rows = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    """Image rows ``[r0, r1)`` (None = all) x columns ``[a, b)`` as ``[C, h, w]`` in the
    file's dtype (16-bit PIL modes as uint16). TIFFs decode only the tiles under the region."""
    a, b = cols
    if _is_npy(path):
        arr = _open_npy(path)
        layout = _npy_layout(arr.shape, path)
        r = slice(None) if rows is None else slice(*rows)
        try:
            if layout == "hw":
                return np.array(arr[None, r, a:b])
            if layout == "chw":
                return np.array(arr[:, r, a:b])
            return np.ascontiguousarray(np.moveaxis(np.array(arr[r, a:b, :]), 2, 0))
        except _READ_ERRORS as e:
            raise bad_file(path, f"cannot read ({type(e).__name__}: {e})") from e
    if _tiled_read(path, level):
        arr = read_region(path, rows, cols, level)
    else:
        arr, mode = _decode_pil(path, cols, rows, True, max_pixels)
        if mode == "I" or mode.startswith("I;16"):
            # PIL opens 16-bit PNGs as 'I' or 'I;16': keep them 16-bit.
            if arr.size and (arr.min() < 0 or arr.max() > 65535):
                raise bad_file(path, "32-bit integer image with values outside [0, 65535]")
            arr = arr.astype(np.uint16)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def read_image(
    path: Path,
    cols: tuple[int, int],
    rows: Rows = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Tensor:
    """Image region as float32 ``[C, h, w]`` scaled by its dtype (``normalize.mode=dtype``)."""
    raw = read_image_raw(path, cols, rows, level=level, max_pixels=max_pixels)
    return scale_by_dtype(raw, path)


def read_mask_raw(
    path: Path,
    cols: tuple[int, int],
    rows: Rows = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    """Mask region ``[h, w]`` in the file's own dtype (no int64 copy), format-checked."""
    a, b = cols
    if _is_npy(path):
        h, w, c = mask_header(path)
        if c != 1:
            raise bad_file(
                path, f"mask array has {c} channels (looks like an RGB mask); " + _RGB_MASK_HINT
            )
        arr = _open_npy(path).reshape(h, w)
        part = np.array(arr[slice(None) if rows is None else slice(*rows), a:b])
        if not (np.issubdtype(part.dtype, np.number) or part.dtype == np.bool_):
            raise bad_file(path, f"unsupported mask dtype {part.dtype}")
    elif is_tiff(path):
        part = read_region(path, rows, cols, level)
        if part.ndim == 3:
            raise bad_file(
                path,
                f"mask has {part.shape[2]} channels, e.g. an RGB colour mask; " + _RGB_MASK_HINT,
            )
    else:
        part, mode = _decode_pil(path, cols, rows, False, max_pixels)
        if mode not in ("L", "P", "1", "I", "F") and not mode.startswith("I;16"):
            channels = part.shape[2] if part.ndim == 3 else 1
            raise bad_file(
                path,
                f"mask has mode {mode} ({channels} channels), e.g. an RGB colour mask; "
                + _RGB_MASK_HINT,
            )
    if np.issubdtype(part.dtype, np.complexfloating):
        raise bad_file(path, f"unsupported mask dtype {part.dtype}")
    if part.dtype.kind == "f" and not (
        np.all(np.isfinite(part)) and np.all(part == np.round(part))
    ):
        raise bad_file(path, "float mask holds non-integer values; masks are class indices")
    return part


def read_mask(
    path: Path,
    cols: tuple[int, int],
    rows: Rows = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Tensor:
    """Mask region as int64 ``[h, w]`` (values not yet range-checked)."""
    part = read_mask_raw(path, cols, rows, level=level, max_pixels=max_pixels)
    return torch.from_numpy(part.astype(np.int64))


def check_mask_values(
    mask: Tensor,
    path: Path,
    num_classes: int,
    ignore_index: int,
    col_offset: int = 0,
    row_offset: int = 0,
) -> None:
    """Raise if ``mask`` holds values outside ``[0, num_classes)`` other than ``ignore_index``."""
    bad = ((mask < 0) | (mask >= num_classes)) & (mask != ignore_index)
    if not bool(bad.any()):
        return
    values = torch.unique(mask[bad])
    row, col = (int(v) for v in bad.nonzero()[0])
    shown = ", ".join(str(int(v)) for v in values[:10]) + (", ..." if len(values) > 10 else "")
    reason = (
        f"mask class index out of range: values [{shown}] (first at row {row + row_offset}, "
        f"column {col + col_offset}) are not in [0, {num_classes}) and not "
        f"ignore_index={ignore_index}"
    )
    present = set(torch.unique(mask).tolist())
    if 255 in present and present <= {0, 255}:
        reason += "; looks like a 0/255 binary mask: divide by 255 or set ignore_index"
    raise bad_file(path, reason)


def image_dtype(path: Path, *, level: int = 0) -> np.dtype | None:
    """The pixel dtype of a TIFF or ``.npy`` image from its header (nothing decoded); None
    for PNG / JPEG and colour-converted TIFFs, which hold integers only."""
    if _is_npy(path):
        return _open_npy(path).dtype
    if _tiled_read(path, level):
        return tiff_header(path, level)[3]
    return None


def nonfinite_reason(pixels: np.ndarray, offsets: tuple[int, ...] = ()) -> str | None:
    """None if every value of ``pixels`` ``[C, *spatial]`` is finite, else what is wrong and
    where the first bad pixel is (``offsets``: the global position of ``pixels[:, 0, ...]``)."""
    if pixels.dtype.kind not in "fc" or bool(np.isfinite(pixels).all()):
        return None
    nan, inf = int(np.isnan(pixels).sum()), int(np.isinf(pixels).sum())
    first = np.argwhere(~np.isfinite(pixels).all(axis=0))[0]
    names = ("slice", "row", "column")[-len(first) :]
    offsets = offsets or (0,) * len(first)
    where = ", ".join(f"{n} {int(i) + o}" for n, i, o in zip(names, first, offsets, strict=True))
    return (
        f"image holds {nan:,} NaN and {inf:,} Inf value(s) (first at {where}); non-finite "
        "pixels make the loss non-finite: replace them (e.g. with 0 or a nodata value the "
        "masks ignore) or remove the file"
    )


def index_folder(folder: Path, exts: frozenset[str], what: str) -> dict[str, Path]:
    """``stem -> path`` of the files in ``folder`` with one of ``exts``; duplicate stems fail."""
    if not folder.is_dir():
        raise DataError(f"{folder}: {what} folder not found", path=str(folder))
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.suffix.lower() not in exts or not path.is_file():
            continue
        if path.stem in found:
            raise DataError(
                f"{folder}: two {what} files share the stem {path.stem!r}: "
                f"{found[path.stem].name} and {path.name}",
                path=str(path),
            )
        found[path.stem] = path
    return found
