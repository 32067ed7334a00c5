"""``FolderDataset``: image/mask pairs from ``root/images/<split>/`` and ``root/masks/<split>/``.

Pairs are matched by file stem (``0001.png`` with ``0001.png`` or ``0001.npy``). See
``_readers`` for the supported formats. Reads are column-range aware: ``.npy`` reads only the
requested columns through a memory map; PIL formats are decoded and cropped.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import Tensor

from ._readers import (
    IMAGE_EXTS,
    MASK_EXTS,
    check_mask_values,
    image_header,
    index_folder,
    mask_header,
    read_image,
    read_mask,
)
from .base import DataError, SegmentationSource, bad_file, check_cols
from .checks import check_decodable

__all__ = ["FolderDataset"]

_MAX_LISTED = 10  # how many stems/problems an error message lists before "... and N more"


def _listing(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f", ... and {more} more" if more > 0 else "")


def _read_split_list(path: Path) -> list[str]:
    """Stems from a text file: one per line, '#' starts a comment, known extensions dropped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise bad_file(path, f"cannot read split list ({e})") from e
    stems: list[str] = []
    for line in lines:
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        name = Path(entry)
        stems.append(name.stem if name.suffix.lower() in IMAGE_EXTS | MASK_EXTS else entry)
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
        split_list: optional text file of stems to use (one per line, ``#`` comments); a
            relative path is looked up as given, then under ``root``.
        class_names: optional names; default: ``root/classes.txt`` if present, else
            ``class_0 ..``.
        on_bad_sample: ``"error"`` (raise on the first ``validate_all``/``load`` problem) or
            ``"skip"`` (``validate_all`` drops bad samples and records them in ``skipped``;
            unpaired files are recorded at construction).

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
        image_dir, mask_dir = self.root / "images" / split, self.root / "masks" / split
        images = index_folder(image_dir, IMAGE_EXTS, "image")
        masks = index_folder(mask_dir, MASK_EXTS, "mask")

        if split_list is not None:
            list_path = Path(split_list)
            if not list_path.exists() and (self.root / list_path).exists():
                list_path = self.root / list_path
            stems = _read_split_list(list_path)
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
            self._headers[i] = image_header(self._items[i][1])
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
        mh, mw, mc = mask_header(mask_path)
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

    def load(self, i: int, cols: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
        """Columns ``[a, b)`` (None = all): image float32 ``[C, H, w]``, mask int64 ``[H, w]``.

        Raises ``DataError`` naming the file for unreadable files, size mismatches and
        out-of-range mask values (only the loaded columns are checked here; ``validate_all``
        checks whole masks).
        """
        _, image_path, mask_path = self._items[i]
        a, b = check_cols(cols, self.size(i)[1], str(image_path))
        self._check_mask_header(i)
        image = read_image(image_path, (a, b))
        mask = read_mask(mask_path, (a, b))
        check_mask_values(mask, mask_path, self.num_classes, self.ignore_index, col_offset=a)
        return image, mask

    def validate_all(self) -> list[tuple[str, str]]:
        """Check every sample up front: readable files, sizes, channels, mask values.

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
                check_decodable(image_path)  # JPEG/TIFF truncation too, cheaply
                mask = read_mask(mask_path, (0, self.size(i)[1]))
                check_mask_values(mask, mask_path, self.num_classes, self.ignore_index)
                seen.update(int(v) for v in mask.unique())
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
        if self.ignore_index == 255 and 255 in seen and seen <= {0, 255}:
            warnings.warn(
                f"{self.root / 'masks' / self.split}: masks hold only 0 and 255 and "
                "ignore_index=255, so every foreground pixel is ignored; looks like 0/255 "
                "binary masks: divide by 255 or change ignore_index",
                stacklevel=2,
            )
        return self.skipped
