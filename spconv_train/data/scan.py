"""Whole-file scans that scale: mask values and image statistics, streamed and cached.

A scan reads a file band by band (a few rows at a time, in the file's own dtype: no int64
copy of a gigapixel mask) and keeps only a small summary: the set of mask values, an
image's per-channel range, or whether a floating-point image holds NaN / Inf. Summaries
are cached in ``run_dir/data_cache.json`` keyed by the file's path, size and mtime, so a
restart does not re-scan and a changed (or touched) file is scanned again. The cache is
used under an exclusive file lock: the first rank to start scans, the others wait and then
read its results (no process group is needed, the scans run before it exists).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._readers import (
    DEFAULT_MAX_PIXELS,
    check_mask_values,
    image_dtype,
    image_header,
    mask_header,
    nonfinite_reason,
    read_image_raw,
    read_mask_raw,
)
from .base import DataError, bad_file
from .normalize import ChannelRange, range_of_bands
from .tiff import is_tiff

__all__ = [
    "CACHE_NAME",
    "ScanCache",
    "check_finite",
    "check_values",
    "image_range",
    "mask_values",
    "normalization_range",
    "row_bands",
]

CACHE_NAME = "data_cache.json"
_BAND_PIXELS = 1 << 24  # pixels per streamed band (16 Mpx: ~16-64 MB in the file's dtype)
_UNSIGNED = {1: np.uint8, 2: np.uint16}
_MAX_VALUES = 4096  # a mask with more distinct values is not a class-index mask


def row_bands(
    height: int, width: int, band_pixels: int = _BAND_PIXELS
) -> Iterator[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` covering ``height`` rows, about ``band_pixels`` each."""
    step = max(1, band_pixels // max(width, 1))
    for r0 in range(0, height, step):
        yield r0, min(r0 + step, height)


class ScanCache:
    """Scan summaries keyed by file identity (path, size, mtime); None path: no caching.

    Use ``with cache.locked():`` around scans so concurrent ranks scan once.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._entries: dict[str, Any] = {}
        self.hits = self.misses = 0

    @staticmethod
    def _identity(files: list[Path]) -> list[list]:
        out = []
        for f in files:
            st = os.stat(f)
            out.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
        return out

    def get(self, kind: str, files: list[Path]) -> Any | None:
        """The cached summary of ``kind`` for ``files``, if none of them changed."""
        key = kind + "|" + "|".join(str(Path(f).resolve()) for f in files)
        entry = self._entries.get(key)
        if entry is not None and entry["files"] == self._identity(files):
            self.hits += 1
            return entry["value"]
        self.misses += 1
        return None

    def put(self, kind: str, files: list[Path], value: Any) -> None:
        """Remember ``value`` (JSON-serialisable) for ``files`` as they are now."""
        key = kind + "|" + "|".join(str(Path(f).resolve()) for f in files)
        self._entries[key] = {"files": self._identity(files), "value": value}

    @contextmanager
    def locked(self) -> Iterator[ScanCache]:
        """Hold the cache's lock file; load the cache on entry, save it on exit."""
        if self.path is None:
            yield self
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_name(self.path.name + ".lock"), "w")  # noqa: SIM115
        except OSError:  # a run folder we cannot write: scan without a cache
            yield self
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._load()
                yield self
                self._save()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            self._entries = data["entries"] if data.get("version") == 1 else {}
        except (OSError, ValueError, KeyError, TypeError):
            self._entries = {}  # no cache or an unreadable one: scan again

    def _save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"version": 1, "entries": self._entries}))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a cache we cannot write only costs a re-scan


def _mask_band_reader(
    path: Path, level: int, max_pixels: int
) -> tuple[Callable[[int, int], np.ndarray], int, int]:
    """``read(r0, r1)`` of full-width mask rows, and ``(H, W)``.

    TIFF and .npy are read band by band; PNG cannot be read partially, so it is decoded
    once (in its own dtype) and sliced.
    """
    h, w, _ = mask_header(path, level=level, max_pixels=max_pixels)
    if is_tiff(path) or path.suffix.lower() == ".npy":
        return (
            lambda r0, r1: read_mask_raw(
                path, (0, w), (r0, r1), level=level, max_pixels=max_pixels
            ),
            h,
            w,
        )
    whole = read_mask_raw(path, (0, w), level=level, max_pixels=max_pixels)
    return (lambda r0, r1: whole[r0:r1]), h, w


def _distinct(band: np.ndarray) -> list[int]:
    """Distinct values of ``band``: a histogram for 8/16-bit and bool (no sort, no copy)."""
    if band.dtype in (np.uint8, np.uint16, np.bool_):
        flat = band.ravel().view(_UNSIGNED[band.dtype.itemsize])
        return np.flatnonzero(np.bincount(flat)).tolist()
    return [int(v) for v in np.unique(band)]


def mask_values(
    path: Path,
    cache: ScanCache | None = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    band_pixels: int = _BAND_PIXELS,
) -> list[int]:
    """Sorted distinct values of a whole mask, streamed band by band (cached).

    Raises ``DataError`` naming the file for unreadable or non-index masks.
    """
    cache = cache or ScanCache(None)
    kind = f"mask_values:level={level}"
    cached = cache.get(kind, [path])
    if cached is not None:
        return cached
    read, h, w = _mask_band_reader(path, level, max_pixels)
    seen: set[int] = set()
    for r0, r1 in row_bands(h, w, band_pixels):
        band = read(r0, r1)
        seen.update(_distinct(band))
        if len(seen) > _MAX_VALUES:
            raise bad_file(
                path,
                f"mask holds more than {_MAX_VALUES} distinct values; masks must hold class "
                "indices (is this an image or an RGB colour mask?)",
            )
    values = sorted(seen)
    cache.put(kind, [path], values)
    return values


def check_values(
    path: Path,
    values: list[int],
    num_classes: int,
    ignore_index: int,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    band_pixels: int = _BAND_PIXELS,
) -> None:
    """Raise a ``DataError`` naming the file, the bad values and where the first one is,
    if ``values`` (from ``mask_values``) hold an out-of-range class index."""
    bad = [v for v in values if not 0 <= v < num_classes and v != ignore_index]
    if not bad:
        return
    read, h, w = _mask_band_reader(path, level, max_pixels)
    for r0, r1 in row_bands(h, w, band_pixels):  # locate it: only on this error path
        band = read(r0, r1)
        if np.isin(band, bad).any():
            band_t = torch.from_numpy(band.astype(np.int64))
            check_mask_values(band_t, path, num_classes, ignore_index, row_offset=r0)
    raise DataError(f"{path}: mask values {bad[:10]} out of range", path=str(path))


def _image_bands(
    path: Path, level: int, max_pixels: int, band_pixels: int
) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, [C, rows, W] pixels)`` of an image, band by band in its own dtype
    (PNG / JPEG, decoded whole anyway: one band)."""
    h, w, _ = image_header(path, level=level, max_pixels=max_pixels)
    if is_tiff(path) or path.suffix.lower() == ".npy":
        for r0, r1 in row_bands(h, w, band_pixels):
            yield r0, read_image_raw(path, (0, w), (r0, r1), level=level, max_pixels=max_pixels)
    else:
        yield 0, read_image_raw(path, (0, w), level=level, max_pixels=max_pixels)


def check_finite(
    path: Path,
    cache: ScanCache | None = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    band_pixels: int = _BAND_PIXELS,
) -> None:
    """Raise a ``DataError`` naming ``path`` (how many NaN / Inf, where the first is) if a
    floating-point image holds a non-finite value; streamed band by band, cached. Integer
    images (every PNG and JPEG) cannot and are not read."""
    dtype = image_dtype(path, level=level)
    if dtype is None or dtype.kind not in "fc":
        return
    cache = cache or ScanCache(None)
    kind = f"image_finite:level={level}"
    reason = cache.get(kind, [path])
    if reason is None:
        reason = ""
        for r0, band in _image_bands(path, level, max_pixels, band_pixels):
            reason = nonfinite_reason(band, (r0, 0)) or ""
            if reason:
                break
        cache.put(kind, [path], reason)  # a restart in skip mode need not read it again
    if reason:
        raise bad_file(path, reason)


def image_range(
    paths: list[Path],
    mode: str,
    percentile: list[float],
    cache: ScanCache | None = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    band_pixels: int = _BAND_PIXELS,
) -> ChannelRange:
    """Per-channel ``(low, high)`` (``minmax`` or ``percentile``) over all pixels of
    ``paths`` (one image: per-image statistics; a split: per-dataset), streamed, cached."""
    cache = cache or ScanCache(None)
    kind = f"image_range:{mode}:{list(percentile) if mode == 'percentile' else ''}:level={level}"
    cached = cache.get(kind, paths)
    if cached is not None:
        return [tuple(v) for v in cached]

    def bands() -> Iterator[np.ndarray]:
        for path in paths:
            yield from (band for _, band in _image_bands(path, level, max_pixels, band_pixels))

    try:
        result = range_of_bands(bands, mode, percentile)
    except ValueError as e:
        raise bad_file(paths[0], f"cannot compute {mode} statistics ({e})") from e
    cache.put(kind, paths, [list(r) for r in result])
    return result


def normalization_range(
    path: Path,
    norm: Any,
    cache: ScanCache | None = None,
    *,
    level: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> ChannelRange | None:
    """The ``stats`` argument of ``normalize_image`` for image ``path`` under ``norm``
    (``data.normalize``): None for ``dtype``/``mean_std``, the stored dataset range for
    ``scope=dataset``, else the whole image's range (streamed; every rank gets the same)."""
    if norm.mode not in ("minmax", "percentile"):
        return None
    if norm.scope == "dataset":
        if norm.stats is None:
            raise ValueError(
                "data.normalize.scope=dataset but data.normalize.stats is null: use the "
                "run's config.yaml (training fills it in) or set the [low, high] pairs"
            )
        return [tuple(r) for r in norm.stats]
    return image_range(
        [Path(path)], norm.mode, norm.percentile, cache, level=level, max_pixels=max_pixels
    )
