"""Band-by-band outputs of big images: tiled, compressed TIFFs written while the bands are
computed (nothing ever holds the whole mask), and a downsampled overlay.

``TiledTiffWriter`` feeds ``tifffile.imwrite`` an iterator of tiles from a background
thread: the prediction loop ``put``s full-width bands of rows (any height) in order, the
writer cuts them into ``tile x tile`` tiles one tile row at a time (holding at most one
tile row plus one band) and tifffile compresses and appends them.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = [
    "OVERLAY_MAX_SIDE",
    "OverlayCanvas",
    "TiledTiffWriter",
    "overlay_factor",
    "write_rank_stats",
]

#: Overlays of bigger images are written downsampled so that their longest side is at most
#: this many pixels (a PNG a viewer can open).
OVERLAY_MAX_SIDE = 4096
_END = object()


def overlay_factor(height: int, width: int, max_side: int = OVERLAY_MAX_SIDE) -> int:
    """Integer downsampling factor of the overlay of a ``height x width`` image."""
    return max(1, math.ceil(max(height, width) / max_side))


class TiledTiffWriter:
    """Write a ``shape`` (``(H, W)`` or ``(H, W, K)``) uint8/uint16 image to a tiled,
    zlib-compressed TIFF at ``path`` from bands of rows given to ``put`` in order."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype, tile: int = 256) -> None:
        import tifffile

        self.path, self.shape, self.tile = Path(path), tuple(shape), tile
        self._queue: queue.Queue = queue.Queue(maxsize=2)  # bounds the bands in flight
        self._error: BaseException | None = None
        self._rows = 0
        self._ended = False  # _END taken from the queue (by _tiles)

        def run() -> None:
            try:
                tifffile.imwrite(
                    self.path,
                    data=self._tiles(),
                    shape=self.shape,
                    dtype=dtype,
                    tile=(tile, tile),
                    compression="zlib",
                    photometric="minisblack",
                    planarconfig="contig" if len(self.shape) == 3 else None,
                    bigtiff=math.prod(self.shape) * np.dtype(dtype).itemsize > 2**31,
                    maxworkers=1,
                    metadata=None,
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = exc
                # unblock the producer (an abort before any band: _tiles took its _END)
                while not self._ended and self._queue.get() is not _END:
                    pass

        self._thread = threading.Thread(target=run, name=f"tiff-{self.path.name}", daemon=True)
        self._thread.start()

    def _tiles(self) -> Iterator[np.ndarray]:
        t, width = self.tile, self.shape[1]
        pending: list[np.ndarray] = []
        held = 0
        while True:
            band = self._queue.get()
            last = band is _END
            if not last:
                pending.append(band)
                held += band.shape[0]
            while held >= t or (last and held):
                rows = np.concatenate(pending) if len(pending) > 1 else pending[0]
                head, rest = rows[:t], rows[t:]
                pending, held = ([rest] if len(rest) else []), len(rest)
                for c in range(0, width, t):
                    yield head[:, c : c + t]
            if last:
                self._ended = True
                return

    def _raise(self) -> None:
        if self._error is not None:
            raise OSError(f"{self.path}: cannot write ({self._error})") from self._error

    def put(self, band: np.ndarray) -> None:
        """Append the next full-width rows (``[rows, W(, K)]``)."""
        self._raise()
        if band.shape[1:] != self.shape[1:]:
            raise ValueError(f"band of shape {band.shape} for an image of shape {self.shape}")
        self._rows += band.shape[0]
        self._queue.put(np.ascontiguousarray(band))

    def close(self) -> None:
        """Finish the file (all ``shape[0]`` rows must have been put)."""
        self._queue.put(_END)
        self._thread.join()
        self._raise()
        if self._rows != self.shape[0]:
            raise ValueError(f"{self.path}: {self._rows} rows written, expected {self.shape[0]}")

    def abort(self) -> None:
        """Stop after an error elsewhere (the partial file is removed)."""
        self._error = self._error or RuntimeError("aborted")
        self._queue.put(_END)
        self._thread.join()
        self.path.unlink(missing_ok=True)


class OverlayCanvas:
    """The RGB overlay of a ``height x width`` image at ``1 / factor`` resolution, filled
    band by band from the pixels whose global row and column are multiples of ``factor``."""

    def __init__(self, height: int, width: int, factor: int) -> None:
        self.factor = factor
        self.pixels = np.zeros((-(-height // factor), -(-width // factor), 3), np.uint8)

    def put(self, rows: tuple[int, int], band: np.ndarray) -> None:
        """Place ``band`` (``[n, W', 3]``: the sampled rows of the output rows ``rows``)."""
        first = -(-rows[0] // self.factor)
        self.pixels[first : first + band.shape[0]] = band

    def save(self, path: Path) -> None:
        """Write the overlay as PNG."""
        from PIL import Image

        Image.fromarray(self.pixels).save(path)


def write_rank_stats(timing: dict) -> None:
    """With ``SPCONV_PREDICT_STATS=DIR`` set (``scripts/bench_predict.py`` does), write this
    rank's peak RSS and read / forward seconds to ``DIR/rank<R>.json``."""
    import json
    import os
    import resource
    import sys

    folder = os.environ.get("SPCONV_PREDICT_STATS")
    if not folder:
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 1024
    rank = int(os.environ.get("RANK", "0"))
    stats = {"rank": rank, "peak_rss_mb": round(peak_mb, 1), **timing}
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(stats) + "\n", encoding="utf-8")
