"""Input normalisation (``data.normalize``), shared by training and ``predict``.

Modes: ``dtype`` (uint8 / 255, uint16 / 65535, floats kept: the historical behaviour),
``minmax`` and ``percentile`` (each channel's [low, high] mapped to [0, 1], per image or
per dataset), ``mean_std`` (dtype scaling, then ``(x - mean) / std``).

A rank sees only its strip, so per-image statistics must come from the whole image:
``image_stats`` streams an image band by band (tile-aware reads) and returns the numbers
every rank then uses. Percentiles are exact for integer images up to 16 bits (a histogram
of every value) and histogram-interpolated (65536 bins) for floats and wider integers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import bad_file

__all__ = [
    "ChannelRange",
    "normalize_image",
    "range_of_bands",
    "scale_by_dtype",
]

ChannelRange = list[tuple[float, float]]
"""Per-channel ``(low, high)`` that ``minmax``/``percentile`` map to ``[0, 1]``."""

_EXACT_BINS = 1 << 16  # integer images spanning at most this many values: exact histogram
_FLOAT_BINS = 1 << 16


def scale_by_dtype(arr: np.ndarray | Tensor, path: object = "image") -> Tensor:
    """float32 ``arr`` divided by its dtype's maximum: uint8 / 255, uint16 / 65535; bool and
    floats kept. Other dtypes fail naming ``path`` (use minmax/percentile for them)."""
    arr = arr.numpy() if isinstance(arr, Tensor) else arr
    if arr.dtype == np.uint8:
        return torch.from_numpy(arr.astype(np.float32)) / 255.0
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.astype(np.float32)) / 65535.0
    if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.floating):
        return torch.from_numpy(arr.astype(np.float32))
    raise bad_file(
        path,
        f"unsupported image dtype {arr.dtype} for data.normalize.mode=dtype (uint8, uint16 "
        "or float); set data.normalize.mode to minmax or percentile",
    )


def _cfg(cfg: Any, name: str, default: Any = None) -> Any:
    """Read a ``NormalizeConfig`` field, or a key of a plain mapping (e.g. a loaded run)."""
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def normalize_image(
    array: np.ndarray | Tensor, cfg: Any, stats: ChannelRange | None = None
) -> Tensor:
    """Raw pixels ``[C, H, W]`` (any region of the image) -> float32 network input.

    Args:
        array: raw pixels in the file's dtype (``read_image_raw``), any region.
        cfg: ``data.normalize`` (``NormalizeConfig`` or the same keys as a mapping).
        stats: per-channel ``(low, high)`` of the whole image or dataset, required by
            ``minmax`` and ``percentile`` (``image_stats`` / ``data.normalize.stats``).

    Identical on every rank and in ``predict``: the result depends on ``stats``, never on
    which region was passed.
    """
    mode = _cfg(cfg, "mode", "dtype")
    if mode == "dtype":
        return scale_by_dtype(array)
    if mode == "mean_std":
        x = scale_by_dtype(array)
        shape = (-1,) + (1,) * (x.dim() - 1)
        mean = torch.tensor(_cfg(cfg, "mean"), dtype=torch.float32).view(shape)
        std = torch.tensor(_cfg(cfg, "std"), dtype=torch.float32).view(shape)
        return (x - mean) / std
    if mode not in ("minmax", "percentile"):
        raise ValueError(f"data.normalize.mode: unknown mode {mode!r}")
    if stats is None:
        raise ValueError(f"data.normalize.mode={mode} needs the image's or dataset's statistics")
    arr = array.numpy() if isinstance(array, Tensor) else array
    x = torch.from_numpy(np.asarray(arr, dtype=np.float32))
    if len(stats) not in (1, x.shape[0]):
        raise ValueError(f"{len(stats)} channel ranges for an image with {x.shape[0]} channels")
    lo = torch.tensor([s[0] for s in stats], dtype=torch.float32)
    hi = torch.tensor([s[1] for s in stats], dtype=torch.float32)
    shape = (-1,) + (1,) * (x.dim() - 1)
    span = (hi - lo).clamp(min=1e-12)  # a constant channel maps to 0
    return ((x - lo.view(shape)) / span.view(shape)).clamp_(0.0, 1.0)


def _band_minmax(bands: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.dtype]:
    lo = hi = None
    dtype = None
    for band in bands:
        flat = band.reshape(band.shape[0], -1)
        if flat.shape[1] == 0:
            continue
        blo, bhi = flat.min(axis=1).astype(np.float64), flat.max(axis=1).astype(np.float64)
        lo = blo if lo is None else np.minimum(lo, blo)
        hi = bhi if hi is None else np.maximum(hi, bhi)
        dtype = band.dtype
    if lo is None:
        raise ValueError("no pixels to compute statistics from")
    return lo, hi, dtype


def _percentile_from_hist(counts: np.ndarray, edges: np.ndarray, q: float, exact: bool) -> float:
    """``np.percentile(values, q)`` (linear) from a histogram: exact for integer bins."""
    total = int(counts.sum())
    pos = q / 100.0 * (total - 1)
    k = int(np.floor(pos))
    cum = np.cumsum(counts)

    def value(i: int) -> float:
        b = int(np.searchsorted(cum, i, side="right"))  # bin holding the i-th sorted value
        if exact:
            return float(edges[b])
        before = cum[b - 1] if b else 0  # interpolate inside a float bin
        frac = (i - before + 0.5) / max(int(counts[b]), 1)
        return float(edges[b] + frac * (edges[b + 1] - edges[b]))

    v0 = value(k)
    v1 = value(min(k + 1, total - 1))
    return v0 + (pos - k) * (v1 - v0)


def range_of_bands(
    bands: Callable[[], Iterator[np.ndarray]], mode: str, percentile: Iterable[float]
) -> ChannelRange:
    """Per-channel ``(low, high)`` of all pixels the ``bands()`` iterator yields.

    ``bands`` returns a fresh iterator of ``[C, h, w]`` raw arrays (the rows of one image,
    or of every image of a dataset); it is called once for ``minmax`` and twice for
    ``percentile`` (min/max, then a histogram), so memory stays one band.
    """
    lo, hi, dtype = _band_minmax(bands())
    if mode == "minmax":
        return [(float(a), float(b)) for a, b in zip(lo, hi, strict=True)]
    q_lo, q_hi = (float(q) for q in percentile)
    channels = len(lo)
    integer = np.issubdtype(dtype, np.integer) or dtype == np.bool_
    exact = integer and float(hi.max() - lo.min()) < _EXACT_BINS
    if exact:
        base = int(lo.min())
        nbins = int(hi.max()) - base + 1
        counts = np.zeros((channels, nbins), dtype=np.int64)
        for band in bands():
            for c in range(channels):
                v = band[c].ravel().astype(np.int64) - base
                counts[c] += np.bincount(v, minlength=nbins)
        edges = np.arange(base, base + nbins + 1, dtype=np.float64)
        hists = [(counts[c], edges) for c in range(channels)]
    else:
        hists = []
        all_counts = np.zeros((channels, _FLOAT_BINS), dtype=np.int64)
        ranges = [(lo[c], hi[c] if hi[c] > lo[c] else lo[c] + 1.0) for c in range(channels)]
        for band in bands():
            for c in range(channels):
                h, _ = np.histogram(band[c], bins=_FLOAT_BINS, range=ranges[c])
                all_counts[c] += h
        for c in range(channels):
            hists.append((all_counts[c], np.linspace(*ranges[c], _FLOAT_BINS + 1)))
    return [
        (
            _percentile_from_hist(counts, edges, q_lo, exact),
            _percentile_from_hist(counts, edges, q_hi, exact),
        )
        for counts, edges in hists
    ]
