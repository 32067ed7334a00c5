"""``VolumeFolder``: 3-D image/mask volumes from ``root/images/<split>/``, ``root/masks/<split>/``.

Pairs are matched by stem. Formats:

* ``.npy``: image ``[D, H, W]`` (one channel) or ``[C, D, H, W]``, mask ``[D, H, W]`` of
  integer class indices. Read through a memory map (``np.load(mmap_mode="r")``): a rank
  touches only the pages of its own block.
* ``.tif`` / ``.tiff``: a multi-page stack, one page per slice (``[D, H, W]``, one
  channel); a rank decodes only the pages of its block's slices.
* ``.nii`` / ``.nii.gz``: NIfTI through ``nibabel`` when it is installed, otherwise refused
  with a clear message. NIfTI voxel axes are (i, j, k) = (x, y, z) (a 4th axis: channels),
  and nibabel indexes them in that order; here D = k (z, the slice axis), H = j (y),
  W = i (x) and C = the 4th axis, i.e. every axis reversed (as SimpleITK's
  ``GetArrayFromImage``, and as a TIFF stack's pages are its z slices). The affine is not
  applied: volumes are read in stored voxel order (reorient them beforehand, e.g. with
  ``nibabel.as_closest_canonical``, if they differ). Slope / intercept scaling is applied.

Every pair is checked up front (readable header, image and mask extents equal, integer mask
with values in ``[0, num_classes)`` or ``ignore_index``, streamed slab by slab); a bad pair
stops the run naming the file, or with ``on_bad_sample="skip"`` is dropped and recorded in
``skipped``. Images are scaled by their dtype (uint8 / 255, uint16 / 65535, floats kept).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ._readers import nonfinite_reason
from .base import DataError, bad_file
from .normalize import scale_by_dtype
from .volumes import Box, VolumeSource

__all__ = ["VOLUME_EXTS", "VolumeFolder", "volume_header"]

VOLUME_EXTS = (".npy", ".tif", ".tiff", ".nii", ".nii.gz")
_SLAB = 8  # slices per read when a whole volume is scanned (mask values)


def _ext(path: Path) -> str:
    name = path.name.lower()
    return ".nii.gz" if name.endswith(".nii.gz") else path.suffix.lower()


def _stem(path: Path) -> str:
    return path.name[: -len(_ext(path))]


def _nibabel():
    if importlib.util.find_spec("nibabel") is None:
        return None
    import nibabel  # noqa: PLC0415 (optional dependency)

    return nibabel


def _open(path: Path):
    """An array-like of the stored volume (indexable by slices without reading it whole)."""
    ext = _ext(path)
    try:
        if ext == ".npy":
            return np.load(path, mmap_mode="r", allow_pickle=False)
        if ext in (".tif", ".tiff"):
            import tifffile  # noqa: PLC0415 (heavy import, only for TIFF stacks)

            return _TiffStack(path, tifffile)
        nib = _nibabel()
        if nib is None:
            raise bad_file(
                path,
                "NIfTI volumes need the nibabel package, which is not installed "
                "(pip install nibabel), or convert the volume to .npy",
            )
        return _NiftiVolume(nib.load(str(path)).dataobj)
    except DataError:
        raise
    except Exception as e:  # a truncated or foreign file: name it
        raise bad_file(path, f"cannot read the volume ({type(e).__name__}: {e})") from e


class _TiffStack:
    """A multi-page TIFF as a ``[D, H, W]`` array-like: slicing decodes only the pages of
    the requested slices."""

    def __init__(self, path: Path, tifffile) -> None:
        self.path, self.tifffile = path, tifffile
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            self.shape, self.dtype = tuple(series.shape), np.dtype(series.dtype)
        if len(self.shape) == 2:
            self.shape = (1, *self.shape)
        if len(self.shape) != 3:
            raise bad_file(
                path,
                f"TIFF stacks must be [D, H, W] (one channel, one page per slice), got shape "
                f"{self.shape}; save multi-channel volumes as .npy [C, D, H, W]",
            )

    def __getitem__(self, box) -> np.ndarray:
        box = tuple(b for b in (box if isinstance(box, tuple) else (box,)) if b is not Ellipsis)
        box += (slice(None),) * (3 - len(box))
        d, rest = box[0], box[1:]
        pages = list(range(*d.indices(self.shape[0])))
        data = self.tifffile.imread(self.path, key=pages) if pages else None
        if data is None:
            return np.zeros((0, *self.shape[1:]), self.dtype)[(slice(None), *rest)]
        return data.reshape(len(pages), *self.shape[1:])[(slice(None), *rest)]


class _NiftiVolume:
    """A NIfTI image's voxels ``(x, y, z[, c])`` as a ``[D, H, W]`` / ``[C, D, H, W]``
    array-like (every axis reversed, see the module docstring). Slicing reads only the
    requested box through nibabel's array proxy (an uncompressed ``.nii`` is memory-mapped;
    a ``.nii.gz`` is decompressed up to the box)."""

    def __init__(self, proxy) -> None:
        self.proxy = proxy
        self.shape = tuple(int(n) for n in proxy.shape[::-1])
        self.ndim = len(self.shape)
        scaled = (getattr(proxy, "slope", 1.0), getattr(proxy, "inter", 0.0)) != (1.0, 0.0)
        # slope / intercept scaling returns floats: report the dtype reads return
        corner = (slice(0, 1),) * self.ndim
        self.dtype = np.asarray(proxy[corner]).dtype if scaled else np.dtype(proxy.dtype)

    def __getitem__(self, box) -> np.ndarray:
        box = box if isinstance(box, tuple) else (box,)
        if any(b is Ellipsis for b in box):
            i = next(k for k, b in enumerate(box) if b is Ellipsis)
            box = (*box[:i], *(slice(None),) * (self.ndim - len(box) + 1), *box[i + 1 :])
        box += (slice(None),) * (self.ndim - len(box))
        return np.asarray(self.proxy[box[::-1]]).transpose()


def volume_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of a stored volume, without reading its voxels."""
    arr = _open(path)
    return tuple(int(n) for n in arr.shape), np.dtype(arr.dtype)


def _index(folder: Path, what: str) -> dict[str, Path]:
    if not folder.is_dir():
        raise DataError(f"{folder}: {what} folder not found", path=str(folder))
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or _ext(path) not in VOLUME_EXTS or not path.is_file():
            continue
        stem = _stem(path)
        if stem in found:
            raise bad_file(path, f"two {what} files share the stem {stem!r}: {found[stem].name}")
        found[stem] = path
    return found


class VolumeFolder(VolumeSource):
    """Volume pairs in ``root/images/<split>/*`` and ``root/masks/<split>/*``.

    Args:
        root: dataset root.
        split: sub-folder name, e.g. ``"train"``.
        num_classes: mask values must be in ``[0, num_classes)`` or equal ``ignore_index``.
        ignore_index: mask value excluded from the loss.
        class_names: optional names; default ``root/classes.txt`` if present.
        on_bad_sample: ``"error"`` (raise on the first problem) or ``"skip"``.

    Attributes:
        skipped: ``(file, reason)`` of every pair dropped in skip mode.
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        *,
        num_classes: int,
        ignore_index: int = 255,
        class_names: list[str] | None = None,
        on_bad_sample: str = "error",
    ) -> None:
        self.root, self.split = Path(root), split
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.skipped: list[tuple[str, str]] = []
        images = _index(self.root / "images" / split, "image")
        masks = _index(self.root / "masks" / split, "mask")
        names = self.root / "classes.txt"
        if class_names is None and names.is_file():
            class_names = [n.strip() for n in names.read_text().splitlines() if n.strip()]
        self.class_names = class_names
        self.pairs: list[tuple[Path, Path]] = []
        self.shapes: list[tuple[int, ...]] = []
        for stem in sorted(set(images) | set(masks)):
            try:
                if stem not in masks:
                    where = self.root / "masks" / split
                    raise bad_file(images[stem], f"no mask named {stem}.* in {where}")
                if stem not in images:
                    where = self.root / "images" / split
                    raise bad_file(masks[stem], f"no image for this mask in {where}")
                self.shapes.append(self._check_pair(images[stem], masks[stem]))
                self.pairs.append((images[stem], masks[stem]))
            except DataError as e:
                if on_bad_sample != "skip":
                    raise
                self.skipped.append((e.path or stem, e.reason))

    def _check_pair(self, image: Path, mask: Path) -> tuple[int, ...]:
        shape, dtype = volume_header(image)
        if len(shape) not in (3, 4):
            raise bad_file(image, f"expected a volume [D, H, W] or [C, D, H, W], got {shape}")
        scale_by_dtype(np.zeros(0, dtype), image)  # an unsupported dtype fails here, named
        mshape, mdtype = volume_header(mask)
        if mshape != shape[-3:]:
            raise bad_file(
                mask, f"mask size {mshape} (DxHxW) does not match its image {shape[-3:]} ({image})"
            )
        if not (np.issubdtype(mdtype, np.integer) or mdtype == np.bool_):
            raise bad_file(mask, f"masks must hold integer class indices, got dtype {mdtype}")
        arr, k, ignore = _open(mask), self.num_classes, self.ignore_index
        for d0 in range(0, mshape[0], _SLAB):
            slab = np.asarray(arr[d0 : d0 + _SLAB]).astype(np.int64)
            bad = (slab != ignore) & ((slab < 0) | (slab >= k))
            if bad.any():
                values = sorted(set(np.unique(slab[bad]).tolist()))[:5]
                raise bad_file(
                    mask,
                    f"mask values {values} are outside [0, {k}) and not ignore_index={ignore} "
                    "(check model.num_classes)",
                )
        if dtype.kind in "fc":  # NaN / Inf: slab by slab, like the mask
            img, whole = _open(image), (slice(None), slice(None))
            for d0 in range(0, shape[-3], _SLAB):
                slab = np.asarray(img[(Ellipsis, slice(d0, d0 + _SLAB), *whole)])
                bad = nonfinite_reason(slab[None] if slab.ndim == 3 else slab, (d0, 0, 0))
                if bad:
                    raise bad_file(image, bad)
        return shape

    def __len__(self) -> int:
        return len(self.pairs)

    def size(self, i: int) -> tuple[int, int, int]:
        """``(D, H, W)`` from the image header."""
        return tuple(self.shapes[i][-3:])  # type: ignore[return-value]

    def channels(self, i: int) -> int:
        """1 for ``[D, H, W]`` volumes, else ``C`` of ``[C, D, H, W]``."""
        return 1 if len(self.shapes[i]) == 3 else self.shapes[i][0]

    def name(self, i: int) -> str:
        """The image file name."""
        return str(self.pairs[i][0])

    def files(self, i: int) -> tuple[Path, Path]:
        """``(image, mask)`` paths of volume ``i``."""
        return self.pairs[i]

    def read(self, i: int, box: Box) -> tuple[Tensor, Tensor]:
        """Only ``box`` of the stored arrays is read (memory map / the slices' pages)."""
        image_path, mask_path = self.pairs[i]
        s = tuple(slice(a, b) for a, b in box)
        try:
            image = np.asarray(_open(image_path)[(Ellipsis, *s)])
            mask = np.asarray(_open(mask_path)[s]).astype(np.int64)
        except DataError:
            raise
        except Exception as e:  # the file changed or broke since the up-front check
            raise bad_file(image_path, f"cannot read the volume ({type(e).__name__}: {e})") from e
        image = image[None] if image.ndim == 3 else image
        bad = nonfinite_reason(image, tuple(a for a, _ in box))
        if bad:
            raise bad_file(image_path, bad)
        return scale_by_dtype(np.ascontiguousarray(image), image_path), torch.from_numpy(mask)
