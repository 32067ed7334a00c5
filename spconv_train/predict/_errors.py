"""The errors of ``spconv-train predict`` (exit code 2)."""

from __future__ import annotations

__all__ = ["ImagesFailed", "PredictError"]


class PredictError(Exception):
    """Bad input for predict (checkpoint, images, masks); exit code 2."""


class ImagesFailed(PredictError):
    """Some images could not be predicted (the others were written); exit code 2.

    Attributes:
        failed: ``{stem: message}`` of every failed image.
        total: number of input images.
    """

    def __init__(self, failed: dict[str, str], total: int) -> None:
        self.failed, self.total = dict(failed), total
        lines = "\n".join(f"  {stem}: {message}" for stem, message in self.failed.items())
        super().__init__(
            f"{len(self.failed)} of {total} image(s) failed (the others were written):\n{lines}"
        )
