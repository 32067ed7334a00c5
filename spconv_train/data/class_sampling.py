"""Class-oversampled crops (``data.oversample_classes``, ``data.oversample_fraction``).

As nnU-Net does, a share of the training crops is centred on a pixel of a rare class. The
pixel comes from an index of class-pixel locations built once per mask by streaming it in
row bands (never the whole mask in memory for TIFF and ``.npy``; a PNG is decoded once),
and cached next to the scans in the run folder (``run_dir/class_index/*.npz``, plain
arrays keyed by the file's path, size and mtime; the first rank to need one builds it
under a file lock, the others wait and read it). Each class keeps at most ``cap``
locations: every ``2**k``-th pixel of the class in row-major order, ``k`` as small as fits.

The choice depends only on ``(seed, epoch, index)`` and the mask, so every rank of a
spatial group picks the same crop without communicating. A mask without any of the
classes falls back to the random crop.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .base import SegmentationSource
from .scan import _mask_band_reader, row_bands
from .transforms import AugmentParams

__all__ = ["ClassSampler", "class_locations", "centre_crop"]

DEFAULT_CAP = 10_000  # locations kept per class and mask (nnU-Net keeps 10000 too)


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def class_locations(
    bands, width: int, classes: list[int], cap: int = DEFAULT_CAP
) -> dict[int, np.ndarray]:
    """Flat pixel indices (``y * width + x``, int64) of each class in ``classes``, from
    ``bands``: ``(r0, band)`` pairs of full-width mask rows in order. At most ``cap`` per
    class: every ``step``-th pixel of the class (row-major), ``step`` a power of two
    doubled whenever more than ``cap`` would be kept, so the result is deterministic."""
    kept = {c: np.zeros(0, np.int64) for c in classes}
    count = dict.fromkeys(classes, 0)
    step = dict.fromkeys(classes, 1)
    for r0, band in bands:
        for c in classes:
            found = np.flatnonzero(band == c).astype(np.int64) + r0 * width
            ranks = count[c] + np.arange(found.size, dtype=np.int64)
            count[c] += found.size
            kept[c] = np.concatenate([kept[c], found[ranks % step[c] == 0]])
            while kept[c].size > cap:
                # kept[j] has rank j * step: doubling the step keeps the even positions.
                kept[c], step[c] = kept[c][::2], step[c] * 2
    return kept


def centre_crop(params: AugmentParams, yx: tuple[int, int]) -> AugmentParams:
    """``params`` with the crop window centred on source pixel ``yx`` (as far as the
    window stays on the resized image; a window larger than the image keeps the offset
    range ``draw_augment`` allows)."""
    (h, w), (hs, ws), (oh, ow) = params.source_hw, params.scaled_hw, params.out_hw

    def offset(pos: int, size: int, scaled: int, out: int) -> int:
        centre = (pos + 0.5) * scaled / size - 0.5  # the pixel's centre after resizing
        start = round(centre - (out - 1) / 2)
        slack = scaled - out
        return min(max(start, min(0, slack)), max(0, slack))

    top, left = offset(yx[0], h, hs, oh), offset(yx[1], w, ws, ow)
    return dataclasses.replace(params, top=top, left=left)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created); without one if it cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "w")  # noqa: SIM115
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class ClassSampler:
    """Chooses, per training sample, whether and where to centre its crop on a rare class.

    Args:
        source: the training source.
        classes: ``data.oversample_classes``.
        fraction: ``data.oversample_fraction``: the probability that a crop is centred on
            one of ``classes`` (chosen uniformly among those the mask holds).
        seed: ``training.seed``.
        cache_dir: folder for the location index (None: kept in memory only).
        cap: locations kept per class and mask.
    """

    def __init__(
        self,
        source: SegmentationSource,
        classes: list[int],
        fraction: float,
        *,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        cap: int = DEFAULT_CAP,
    ) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"data.oversample_fraction must be in [0, 1], got {fraction}")
        self.source, self.classes = source, sorted({int(c) for c in classes})
        self.fraction, self.seed, self.cap = float(fraction), int(seed), int(cap)
        self.cache_dir = None if cache_dir is None else Path(cache_dir) / "class_index"
        self._index: dict[int, dict[int, np.ndarray]] = {}

    def _bands(self, index: int):
        """``(r0, rows)`` bands of the whole mask ``index``, in its own dtype if a file."""
        files = getattr(self.source, "files", None)
        if files is not None:
            level = getattr(self.source, "level", 0)
            max_pixels = getattr(self.source, "max_pixels", 2_000_000_000)
            read, h, w = _mask_band_reader(Path(files(index)[1]), level, max_pixels)
            return ((r0, read(r0, r1)) for r0, r1 in row_bands(h, w)), w
        h, w = self.source.size(index)
        bands = (
            (r0, self.source.load(index, None, (r0, r1))[1].numpy()) for r0, r1 in row_bands(h, w)
        )
        return bands, w

    def _cache_file(self, index: int) -> Path | None:
        files = getattr(self.source, "files", None)
        if self.cache_dir is None or files is None:
            return None
        path = Path(files(index)[1]).resolve()
        st = os.stat(path)
        key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{getattr(self.source, 'level', 0)}"
        key += f"|{self.classes}|{self.cap}"
        name = hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
        return self.cache_dir / f"{path.stem}-{name}.npz"

    def locations(self, index: int) -> dict[int, np.ndarray]:
        """Flat indices of each class's pixels in mask ``index`` (built once, cached)."""
        if index not in self._index:
            cached = self._cache_file(index)
            if cached is None:
                self._index[index] = self._build(index)
            else:
                # One rank builds, the others wait and read its file (as ScanCache does).
                with _locked(cached.with_name(cached.name + ".lock")):
                    found = self._read(cached)
                    if found is None:
                        found = self._build(index)
                        self._save(cached, found)
                self._index[index] = found
        return self._index[index]

    def _build(self, index: int) -> dict[int, np.ndarray]:
        bands, width = self._bands(index)
        return class_locations(bands, width, self.classes, self.cap)

    def _read(self, path: Path) -> dict[int, np.ndarray] | None:
        """The cached index, or None when absent or unreadable (then it is built again)."""
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                return {c: data[f"class_{c}"] for c in self.classes}
        except (OSError, ValueError, KeyError):
            return None

    @staticmethod
    def _save(path: Path, found: dict[int, np.ndarray]) -> None:
        """Write atomically (a reader never sees half a file)."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.npz")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, **{f"class_{c}": v for c, v in found.items()})
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # an index we cannot write only costs a rebuild

    def pick(self, index: int, epoch: int) -> tuple[int, int] | None:
        """The source pixel ``(y, x)`` sample ``index``'s crop is centred on in ``epoch``,
        or None for a random crop (not drawn, or the mask holds none of the classes)."""
        g = torch.Generator().manual_seed(_seed("oversample", self.seed, epoch, index))
        u = torch.rand(3, generator=g, dtype=torch.float64).tolist()
        if u[0] >= self.fraction or not self.classes:
            return None
        found = self.locations(index)
        present = [c for c in self.classes if found[c].size]
        if not present:
            return None
        locs = found[present[min(int(u[1] * len(present)), len(present) - 1)]]
        flat = int(locs[min(int(u[2] * locs.size), locs.size - 1)])
        width = self.source.size(index)[1]
        return flat // width, flat % width

    def recentre(self, index: int, epoch: int):
        """A function moving a crop onto ``pick(index, epoch)`` (identity when None), for
        ``augment_v2.draw_plan(recentre=...)``."""
        yx = self.pick(index, epoch)
        return (lambda p: p) if yx is None else (lambda p: centre_crop(p, yx))
