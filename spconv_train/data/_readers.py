"""Low-level image and mask readers: headers without decoding, and column-range reads.

Every failure is a ``DataError`` naming the file. Supported:
- images: PNG, JPEG, TIFF (PIL) and ``.npy`` (``[H, W]``, ``[C, H, W]`` or ``[H, W, C]``;
  the channel axis is the shorter of the first and last axes, ``[C, H, W]`` on a tie);
  uint8 is divided by 255, uint16 (and PIL's 16-bit modes) by 65535, floats are kept.
- masks: PNG, TIFF (modes L, P (palette indices), 1, I, I;16) and ``.npy`` (``[H, W]``
  integer, or a singleton channel axis); values are class indices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from .base import DataError, bad_file

IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".tif", ".tiff", ".npy"})
MASK_EXTS = frozenset({".png", ".tif", ".tiff", ".npy"})
_READ_ERRORS = (OSError, ValueError, SyntaxError, UnidentifiedImageError, EOFError)
_MULTI_BAND = {"P": 3, "CMYK": 3, "YCbCr": 3, "LAB": 3, "HSV": 3}  # converted to RGB on read
_RGB_MASK_HINT = (
    "masks must hold one class index per pixel; convert the colours to class indices "
    "(e.g. an 'L' or palette 'P' PNG via a colour-to-index table)"
)


def _is_npy(path: Path) -> bool:
    return path.suffix.lower() == ".npy"


def _open_pil(path: Path) -> Image.Image:
    try:
        return Image.open(path)
    except _READ_ERRORS as e:
        raise bad_file(path, f"cannot read ({type(e).__name__}: {e})") from e


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


def image_header(path: Path) -> tuple[int, int, int]:
    """``(H, W, C)`` of an image file, without decoding its pixels."""
    if _is_npy(path):
        shape = _open_npy(path).shape
        layout = _npy_layout(shape, path)
        if layout == "hw":
            return shape[0], shape[1], 1
        return (shape[1], shape[2], shape[0]) if layout == "chw" else (shape[0], shape[1], shape[2])
    with _open_pil(path) as img:
        w, h = img.size
        return h, w, _MULTI_BAND.get(img.mode, len(img.getbands()))


def mask_header(path: Path) -> tuple[int, int, int]:
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
    with _open_pil(path) as img:
        w, h = img.size
        return h, w, 1 if img.mode == "P" else len(img.getbands())


def verify_image(path: Path) -> None:
    """Cheap integrity check (PIL ``verify``: PNG chunk CRCs, truncation) without decoding."""
    if _is_npy(path):
        _open_npy(path)
        return
    try:
        with Image.open(path) as img:
            img.verify()
    except _READ_ERRORS as e:
        raise bad_file(path, f"corrupt or truncated image ({type(e).__name__}: {e})") from e


def _to_float(arr: np.ndarray, path: Path) -> Tensor:
    """uint8 / 255, uint16 / 65535, bool and floats as float32."""
    if arr.dtype == np.uint8:
        return torch.from_numpy(arr.astype(np.float32)) / 255.0
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.astype(np.float32)) / 65535.0
    if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.floating):
        return torch.from_numpy(arr.astype(np.float32))
    raise bad_file(path, f"unsupported image dtype {arr.dtype} (use uint8, uint16 or float)")


def _decode_pil(path: Path, cols: tuple[int, int], image: bool) -> tuple[np.ndarray, str]:
    """Pixels of columns ``[a, b)`` and the PIL mode; PNG/JPEG are decoded whole, TIFF cropped.

    For images, palette/CMYK/... modes are converted to RGB and '1' to 'L'; masks are
    returned as stored (a 'P' mask gives its palette indices, which are the class indices).
    """
    a, b = cols
    try:
        with Image.open(path) as img:
            part = img.crop((a, 0, b, img.size[1])) if (a, b) != (0, img.size[0]) else img
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


def read_image(path: Path, cols: tuple[int, int]) -> Tensor:
    """Image columns ``[a, b)`` as float32 ``[C, H, b - a]``."""
    a, b = cols
    if _is_npy(path):
        arr = _open_npy(path)
        layout = _npy_layout(arr.shape, path)
        try:
            if layout == "hw":
                part = np.array(arr[None, :, a:b])
            elif layout == "chw":
                part = np.array(arr[:, :, a:b])
            else:
                part = np.ascontiguousarray(np.moveaxis(np.array(arr[:, a:b, :]), 2, 0))
        except _READ_ERRORS as e:
            raise bad_file(path, f"cannot read ({type(e).__name__}: {e})") from e
        return _to_float(part, path)
    arr, mode = _decode_pil(path, cols, image=True)
    if mode == "I" or mode.startswith("I;16"):
        # PIL opens 16-bit PNG/TIFF as 'I' or 'I;16': scale by the 16-bit range.
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise bad_file(path, "32-bit integer image with values outside [0, 65535]")
        arr = arr.astype(np.uint16)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return _to_float(np.ascontiguousarray(arr.transpose(2, 0, 1)), path)


def read_mask(path: Path, cols: tuple[int, int]) -> Tensor:
    """Mask columns ``[a, b)`` as int64 ``[H, b - a]`` (values not yet range-checked)."""
    a, b = cols
    if _is_npy(path):
        h, w, c = mask_header(path)
        if c != 1:
            raise bad_file(
                path, f"mask array has {c} channels (looks like an RGB mask); " + _RGB_MASK_HINT
            )
        arr = _open_npy(path).reshape(h, w)
        part = np.array(arr[:, a:b])
        if np.issubdtype(part.dtype, np.floating):
            if not np.all(np.isfinite(part)) or not np.all(part == np.round(part)):
                raise bad_file(path, "float mask holds non-integer values; masks are class indices")
        elif not (np.issubdtype(part.dtype, np.integer) or part.dtype == np.bool_):
            raise bad_file(path, f"unsupported mask dtype {part.dtype}")
        return torch.from_numpy(part.astype(np.int64))
    arr, mode = _decode_pil(path, cols, image=False)
    if mode not in ("L", "P", "1", "I", "F") and not mode.startswith("I;16"):
        channels = arr.shape[2] if arr.ndim == 3 else 1
        raise bad_file(
            path,
            f"mask has mode {mode} ({channels} channels), e.g. an RGB colour mask; "
            + _RGB_MASK_HINT,
        )
    if arr.dtype.kind == "f" and not np.all(arr == np.round(arr)):
        raise bad_file(path, "float mask holds non-integer values; masks are class indices")
    return torch.from_numpy(arr.astype(np.int64))


def check_mask_values(
    mask: Tensor, path: Path, num_classes: int, ignore_index: int, col_offset: int = 0
) -> None:
    """Raise if ``mask`` holds values outside ``[0, num_classes)`` other than ``ignore_index``."""
    bad = ((mask < 0) | (mask >= num_classes)) & (mask != ignore_index)
    if not bool(bad.any()):
        return
    values = torch.unique(mask[bad])
    row, col = (int(v) for v in bad.nonzero()[0])
    shown = ", ".join(str(int(v)) for v in values[:10]) + (", ..." if len(values) > 10 else "")
    reason = (
        f"mask class index out of range: values [{shown}] (first at row {row}, column "
        f"{col + col_offset}) are not in [0, {num_classes}) and not ignore_index={ignore_index}"
    )
    present = set(torch.unique(mask).tolist())
    if 255 in present and present <= {0, 255}:
        reason += "; looks like a 0/255 binary mask: divide by 255 or set ignore_index"
    raise bad_file(path, reason)


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
