"""``FolderDataset``: image/mask pairs from ``root/images/<split>/`` and ``root/masks/<split>/``.

Pairs are matched by file stem (``0001.png`` with ``0001.png`` or ``0001.npy``). See
``_readers`` for the supported formats. Reads are region aware: TIFFs decode only the tiles
under the requested rows and columns, ``.npy`` reads them through a memory map; PNG/JPEG are
decoded whole (up to ``max_image_pixels``) and cropped. Whole-file scans (mask values,
normalisation statistics) are streamed and cached (``scan``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch import Tensor

from ._readers import (
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTS,
    MASK_EXTS,
    check_mask_values,
    image_header,
    index_folder,
    mask_header,
    nonfinite_reason,
    read_image_raw,
    read_mask,
)
from .base import DataError, SegmentationSource, bad_file, check_cols
from .checks import check_decodable
from .normalize import ChannelRange, normalize_image
from .scan import (
    ScanCache,
    check_finite,
    check_values,
    image_range,
    mask_values,
    normalization_range,
)
from .sizes import check_piece_size, warn_crop_larger

__all__ = ["FolderDataset"]

_MAX_LISTED = 10  # how many stems/problems an error message lists before "... and N more"


def _listing(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f", ... and {more} more" if more > 0 else "")


def _read_split_list(path: Path, split: str) -> list[str] | None:
    """Stems of ``split`` from a split list; None when the file does not mention ``split``.

    Documented format: one ``<split> <stem>`` pair per line (``train slide_001``); a line
    with a single word names a stem used by every split. ``#`` starts a comment, known
    extensions are dropped (``a.png`` -> ``a``).
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise bad_file(path, f"cannot read split list ({e})") from e
    stems: list[str] = []
    mentioned = False
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise bad_file(
                path, f"line {number}: expected '<split> <stem>' or '<stem>', got {line.strip()!r}"
            )
        if len(words) == 2:
            if words[0] != split:
                continue
            mentioned = True
        name = Path(words[-1])
        stems.append(name.stem if name.suffix.lower() in IMAGE_EXTS | MASK_EXTS else words[-1])
    if not stems and not mentioned:
        return None
    dupes = sorted({s for s in stems if stems.count(s) > 1})
    if dupes:
        raise bad_file(path, f"split list names these stems more than once: {_listing(dupes)}")
    return stems


class FolderDataset(SegmentationSource):
    """Segmentation pairs in ``root/images/<split>/*`` and ``root/masks/<split>/*``.

    Args:
        root: dataset root.
        split: sub-folder name, e.g. ``"train"`` or ``"val"``.
        num_classes: number of classes; mask values must be in ``[0, num_classes)`` or equal
            ``ignore_index``.
        ignore_index: mask value excluded from the loss.
        split_list: optional text file of ``<split> <stem>`` lines (or bare ``<stem>`` lines
            for every split; ``#`` comments); a split it does not mention uses every stem. A
            relative path is looked up as given, then under ``root``.
        class_names: optional names; default: ``root/classes.txt`` if present, else
            ``class_0 ..``.
        on_bad_sample: ``"error"`` (raise on the first ``validate_all``/``load`` problem) or
            ``"skip"`` (``validate_all`` drops bad samples and records them in ``skipped``;
            unpaired files are recorded at construction).
        level: pyramid level of pyramidal TIFFs (``data.level``).
        max_image_pixels: largest PNG/JPEG decoded (``data.max_image_pixels``).
        normalize: ``data.normalize`` (None: ``dtype``); ``minmax``/``percentile`` need
            ``prepare_normalization`` (or compute per-image statistics on first use).

    Attributes:
        skipped: ``(file, reason)`` of every sample dropped in skip mode.
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        *,
        num_classes: int,
        ignore_index: int = 255,
        split_list: str | Path | None = None,
        class_names: list[str] | None = None,
        on_bad_sample: str = "error",
        level: int = 0,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
        normalize: Any = None,
    ) -> None:
        if on_bad_sample not in ("error", "skip"):
            raise ValueError(f"on_bad_sample must be 'error' or 'skip', got {on_bad_sample!r}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.root, self.split = Path(root), split
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.on_bad_sample = on_bad_sample
        self.skipped: list[tuple[str, str]] = []
        self._headers: dict[int, tuple[int, int, int]] = {}
        self.level, self.max_pixels, self.normalize = level, max_image_pixels, normalize
        self._ranges: dict[Path, ChannelRange] = {}  # per-image minmax/percentile
        self.dataset_range: ChannelRange | None = None  # scope=dataset
        image_dir, mask_dir = self.root / "images" / split, self.root / "masks" / split
        images = index_folder(image_dir, IMAGE_EXTS, "image")
        masks = index_folder(mask_dir, MASK_EXTS, "mask")

        listed: list[str] | None = None
        if split_list is not None:
            list_path = Path(split_list)
            if not list_path.exists() and (self.root / list_path).exists():
                list_path = self.root / list_path
            listed = _read_split_list(list_path, split)
        if listed is not None:
            stems = listed
            self._check_pairs(stems, images, masks, f"listed in {list_path} but")
        else:
            stems = sorted(images.keys() | masks.keys())
            self._check_pairs(stems, images, masks, "")
        stems = [s for s in stems if s in images and s in masks]
        if not stems:
            raise DataError(f"{image_dir}: no image/mask pairs found", path=str(image_dir))
        self._items: list[tuple[str, Path, Path]] = [(s, images[s], masks[s]) for s in stems]
        self.class_names = self._class_names(class_names)

    def _check_pairs(
        self, stems: list[str], images: dict[str, Path], masks: dict[str, Path], prefix: str
    ) -> None:
        """Fail (or record in skip mode) stems missing an image or a mask, naming them."""
        no_mask = [s for s in stems if s not in masks]
        no_image = [s for s in stems if s not in images]
        problems = []
        mask_dir, image_dir = self.root / "masks" / self.split, self.root / "images" / self.split
        if no_mask:
            files = [images[s].name if s in images else s for s in no_mask]
            problems.append(f"{prefix} no mask in {mask_dir} for: {_listing(files)}")
        if no_image:
            files = [masks[s].name if s in masks else s for s in no_image]
            problems.append(f"{prefix} no image in {image_dir} for: {_listing(files)}")
        if not problems:
            return
        if self.on_bad_sample == "error":
            raise DataError("missing image/mask pairs: " + "; ".join(p.strip() for p in problems))
        for s in no_mask:
            self.skipped.append((str(images.get(s, image_dir / s)), "no matching mask"))
        for s in no_image:
            self.skipped.append((str(masks.get(s, mask_dir / s)), "no matching image"))

    def _class_names(self, given: list[str] | None) -> list[str]:
        names_file = self.root / "classes.txt"
        if given is None and names_file.is_file():
            given = [ln.strip() for ln in names_file.read_text().splitlines() if ln.strip()]
            if len(given) != self.num_classes:
                raise bad_file(
                    names_file, f"lists {len(given)} classes but num_classes={self.num_classes}"
                )
        if given is None:
            return [f"class_{k}" for k in range(self.num_classes)]
        if len(given) != self.num_classes:
            raise ValueError(f"{len(given)} class_names given for num_classes={self.num_classes}")
        return list(given)

    # --- SegmentationSource -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    def name(self, i: int) -> str:
        """The file stem of sample ``i``."""
        return self._items[i][0]

    def files(self, i: int) -> tuple[Path, Path]:
        """``(image_path, mask_path)`` of sample ``i``."""
        return self._items[i][1], self._items[i][2]

    def _header(self, i: int) -> tuple[int, int, int]:
        if i not in self._headers:  # files are assumed not to change while training
            self._headers[i] = image_header(
                self._items[i][1], level=self.level, max_pixels=self.max_pixels
            )
        return self._headers[i]

    def size(self, i: int) -> tuple[int, int]:
        """``(H, W)`` from the image header (PIL lazy open, npy memory map)."""
        h, w, _ = self._header(i)
        return h, w

    def channels(self, i: int) -> int:
        """Number of channels the image loads with (palette/CMYK images load as RGB)."""
        return self._header(i)[2]

    def _check_mask_header(self, i: int) -> None:
        _, image_path, mask_path = self._items[i]
        h, w, _ = self._header(i)
        mh, mw, mc = mask_header(mask_path, level=self.level, max_pixels=self.max_pixels)
        if (mh, mw) != (h, w):
            raise bad_file(
                mask_path,
                f"mask size {mh}x{mw} (HxW) differs from image {image_path.name} size {h}x{w}",
            )
        if mc != 1:
            raise bad_file(
                mask_path,
                f"mask has {mc} channels (looks like an RGB colour mask); masks must hold one "
                "class index per pixel: convert colours to class indices",
            )

    def load(
        self, i: int, cols: tuple[int, int] | None = None, rows: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rows (None = all) x columns ``[a, b)`` (None = all): image float32 ``[C, h, w]``
        normalised per ``data.normalize``, mask int64 ``[h, w]``.

        Only the region is decoded for TIFF (its tiles) and ``.npy``. Raises ``DataError``
        naming the file for unreadable files, size mismatches, NaN / Inf pixels in the region
        and out-of-range mask values
        (only the loaded region is checked here; ``validate_all`` checks whole masks).
        """
        _, image_path, mask_path = self._items[i]
        h, w = self.size(i)
        a, b = check_cols(cols, w, str(image_path))
        if rows is not None and not 0 <= rows[0] <= rows[1] <= h:
            raise ValueError(f"{image_path}: row range {rows} is outside [0, {h})")
        self._check_mask_header(i)
        kw = {"level": self.level, "max_pixels": self.max_pixels}
        raw = read_image_raw(image_path, (a, b), rows, **kw)
        # Checked up front too (validate_all); here for files changed since, or never checked.
        bad = nonfinite_reason(raw, (0 if rows is None else rows[0], a))
        if bad:
            raise bad_file(image_path, bad)
        image = normalize_image(raw, self.normalize or {}, self._range(i))
        mask = read_mask(mask_path, (a, b), rows, **kw)
        check_mask_values(
            mask,
            mask_path,
            self.num_classes,
            self.ignore_index,
            col_offset=a,
            row_offset=0 if rows is None else rows[0],
        )
        return image, mask

    def _range(self, i: int) -> ChannelRange | None:
        """The ``(low, high)`` per channel that ``minmax``/``percentile`` use for sample i:
        whole-image (or dataset) statistics, never the loaded strip's."""
        norm = self.normalize
        if getattr(norm, "mode", "dtype") not in ("minmax", "percentile"):
            return None
        if norm.scope == "dataset":
            if self.dataset_range is None:
                self.prepare_normalization()
            return self.dataset_range
        _, image_path, _ = self._items[i]
        if image_path not in self._ranges:
            kw = {"level": self.level, "max_pixels": self.max_pixels}
            self._ranges[image_path] = normalization_range(image_path, norm, **kw)
        return self._ranges[image_path]

    def prepare_normalization(
        self, cache: ScanCache | None = None, dataset_range: ChannelRange | None = None
    ) -> ChannelRange | None:
        """Compute the ``minmax``/``percentile`` statistics up front (streamed, cached).

        Per image: every image's own range. Per dataset: the range over every image of
        this split, unless ``dataset_range`` (e.g. the training split's, for validation)
        or ``normalize.stats`` is given. Returns the dataset range (None per image).
        """
        norm = self.normalize
        mode = getattr(norm, "mode", "dtype")
        if mode not in ("minmax", "percentile"):
            return None
        kw = {"level": self.level, "max_pixels": self.max_pixels}
        if norm.scope == "dataset":
            if norm.stats is not None:
                dataset_range = [tuple(r) for r in norm.stats]
            if dataset_range is None:
                paths = [image_path for _, image_path, _ in self._items]
                dataset_range = image_range(paths, mode, norm.percentile, cache, **kw)
            self.dataset_range = dataset_range
            return dataset_range
        for _, image_path, _ in self._items:
            self._ranges[image_path] = normalization_range(image_path, norm, cache, **kw)
        return None

    def validate_all(
        self,
        cache: ScanCache | None = None,
        *,
        grid: tuple[int, int] = (1, 1),
        crop: tuple[int | None, int | None] | None = None,
    ) -> list[tuple[str, str]]:
        """Check every sample up front: readable files, sizes, channels, mask values, and
        NaN / Inf in floating-point images.

        First, from the headers alone: a rank's piece of an image (``grid``: rows x columns
        of spatial ranks; read whole, or with the training ``crop`` ``(height, width)``
        along the dims it sets) must be at most ``max_image_pixels``
        (``sizes.check_piece_size``), before anything is read.

        Masks are scanned band by band in their own dtype; with a ``cache`` (in the run
        folder) a file scanned before and unchanged (size, mtime) is not read again.

        In ``"error"`` mode raises one ``DataError`` listing every problem (each naming its
        file). In ``"skip"`` mode drops the bad samples, appends them to ``skipped`` and
        returns ``skipped``. Warns when every labelled pixel is 0 or ``ignore_index`` = 255
        (0/255 binary masks whose foreground would silently be ignored).
        """
        problems: list[tuple[int, str, str]] = []
        seen: set[int] = set()
        channels: dict[int, list[int]] = {}
        for i, (_, image_path, mask_path) in enumerate(self._items):
            try:
                self._check_mask_header(i)
                kw = {"level": self.level, "max_pixels": self.max_pixels}
                piece = {"grid": grid, "crop": crop, "max_pixels": self.max_pixels}
                check_piece_size(image_path, self.size(i), what=self.split, **piece)  # headers
                check_decodable(image_path, **kw)  # JPEG/TIFF truncation too, cheaply
                check_finite(image_path, cache, **kw)  # NaN / Inf: float TIFF / .npy only
                values = mask_values(mask_path, cache, **kw)
                check_values(mask_path, values, self.num_classes, self.ignore_index, **kw)
                seen.update(values)
                channels.setdefault(self.channels(i), []).append(i)
            except DataError as e:
                problems.append((i, e.path or str(mask_path), e.reason))
        if len(channels) > 1:  # a batch needs one channel count; the majority wins
            common = max(channels, key=lambda c: len(channels[c]))
            for c, members in channels.items():
                if c != common:
                    problems += [
                        (i, str(self._items[i][1]), f"image has {c} channels, most have {common}")
                        for i in members
                    ]
        if problems and self.on_bad_sample == "error":
            lines = [f"{path}: {reason}" for _, path, reason in problems]
            raise DataError(
                f"{len(problems)} bad sample(s) in {self.root / 'images' / self.split}:\n  "
                + "\n  ".join(lines[: 2 * _MAX_LISTED])
                + (f"\n  ... and {len(lines) - 2 * _MAX_LISTED} more" if len(lines) > 20 else ""),
                path=problems[0][1],
            )
        if problems:
            bad = {i for i, _, _ in problems}
            self.skipped += [(path, reason) for _, path, reason in problems]
            self._items = [item for i, item in enumerate(self._items) if i not in bad]
            self._headers.clear()  # indices shifted
            if not self._items:
                raise DataError(f"{self.root}: every sample of split {self.split!r} is bad")
        sizes = [(image, self.size(i)) for i, (_, image, _) in enumerate(self._items)]
        warn_crop_larger(self.root / "images" / self.split, sizes, crop)
        if self.ignore_index == 255 and 255 in seen and seen <= {0, 255}:
            warnings.warn(
                f"{self.root / 'masks' / self.split}: masks hold only 0 and 255 and "
                "ignore_index=255, so every foreground pixel is ignored; looks like 0/255 "
                "binary masks: divide by 255 or change ignore_index",
                stacklevel=2,
            )
        return self.skipped
