"""Progress of ``predict`` over images and the pieces (bands, tiles) of each, with an ETA.

Only global rank 0 shows it, on stderr: a rich progress bar on a terminal, else a plain
line at most every ``PLAIN_EVERY_S`` seconds and at the end of every image (logs, CI).
The estimate assumes the remaining pieces cost what the finished ones did on average.
"""

from __future__ import annotations

import sys
import time

__all__ = ["PLAIN_EVERY_S", "PredictProgress"]

PLAIN_EVERY_S = 10.0


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class PredictProgress:
    """Progress over ``images`` images (``enabled`` on global rank 0 only)."""

    def __init__(self, images: int, enabled: bool, stream=None) -> None:
        self.images, self.enabled = max(images, 1), enabled
        self.stream = stream or sys.stderr
        self.done_images, self.stem, self.pieces, self.done_pieces = 0, "", 1, 0
        self.start = self.last = time.monotonic()
        self._bar = self._task = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(file=self.stream), transient=False,
            )  # fmt: skip
            self._task = self._bar.add_task("predict", total=float(self.images))
            self._bar.start()

    @property
    def fraction(self) -> float:
        """Share of the work done (finished images plus the current image's pieces)."""
        return (self.done_images + self.done_pieces / self.pieces) / self.images

    def _label(self) -> str:
        return (
            f"image {min(self.done_images + 1, self.images)}/{self.images} {self.stem}: "
            f"piece {self.done_pieces}/{self.pieces}"
        )

    def image(self, stem: str, pieces: int) -> None:
        """A new image of ``pieces`` pieces starts."""
        self.stem, self.pieces, self.done_pieces = stem, max(pieces, 1), 0
        self._show(force=False)

    def advance(self) -> None:
        """One piece of the current image is done (the image, after its last piece)."""
        self.done_pieces += 1
        end = self.done_pieces >= self.pieces
        self._show(force=end)
        if end:
            self.done_images += 1
            self.done_pieces, self.pieces = 0, 1

    def _show(self, force: bool) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.fraction * self.images,
                             description=self._label())  # fmt: skip
            return
        now = time.monotonic()
        if not force and now - self.last < PLAIN_EVERY_S:
            return
        self.last, elapsed, f = now, now - self.start, self.fraction
        eta = _clock(elapsed * (1 - f) / f) if f > 0 else "?"
        print(f"predict: {self._label()} ({100 * f:.0f} %), elapsed {_clock(elapsed)}, "
              f"ETA {eta}", file=self.stream, flush=True)  # fmt: skip

    def close(self) -> None:
        """Stop the bar."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
