"""Row bands of a tall image: which rows each band reads and keeps (the same for the
columns of tiles), and the region read every band goes through. How big the bands are is
the memory plan's choice (``_memory_plan``).

A band keeps the output rows ``[r0, r1)`` (``r0`` a multiple of the band height, itself a
multiple of the network's total stride) and reads the input rows ``[r0 - margin, r1 +
margin)`` clipped to the image, so that its first row is still on the stride grid (the
margin is a multiple of the stride too) and its border padding only reaches the
discarded margin rows. See ``_receptive`` for where stride and margin come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from spconv_train.data import normalize_image, read_image_raw, read_mask

__all__ = [
    "Band",
    "band_layout",
    "read_mask_rows_cols",
    "read_rows_cols",
]


@dataclass(frozen=True)
class Band:
    """Output rows ``rows = (r0, r1)`` kept from a forward of the input rows ``read``."""

    rows: tuple[int, int]
    read: tuple[int, int]


def band_layout(height: int, band_rows: int, plan) -> list[Band]:
    """The bands covering ``height`` rows: ``band_rows`` (rounded up to the plan's stride)
    kept rows each, read with ``plan.margin`` context rows on each side."""
    step = -(-max(band_rows, 1) // plan.stride) * plan.stride
    m = plan.margin
    return [
        Band((r0, min(height, r0 + step)), (max(0, r0 - m), min(height, r0 + step + m)))
        for r0 in range(0, height, step)
    ]


def read_rows_cols(
    path: Path,
    rows: tuple[int, int],
    cols: tuple[int, int],
    normalize: Any = None,
    stats: Any = None,
    **read: Any,
) -> Tensor:
    """Image rows ``[r0, r1)`` of columns ``[a, b)`` as float32 ``[C, r1 - r0, b - a]``,
    normalised as in training (``data.normalize`` and the whole image's ``stats``; None:
    scaled by the dtype). The one region read of band-streamed prediction: ``.npy`` files
    are memory-mapped and TIFFs decode only the tiles under the region (``read``: the
    reader's ``level`` / ``max_pixels``)."""
    return normalize_image(read_image_raw(path, cols, rows, **read), normalize, stats)


def read_mask_rows_cols(
    path: Path, rows: tuple[int, int], cols: tuple[int, int], **read: Any
) -> Tensor:
    """Mask rows ``[r0, r1)`` of columns ``[a, b)`` as int64 (values not range-checked)."""
    return read_mask(path, cols, rows, **read)
