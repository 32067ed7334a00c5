"""The errors of ``spconv-train predict`` (exit code 2)."""

from __future__ import annotations

__all__ = ["SHARED_ERRORS", "ImagesFailed", "PredictError"]


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


def _shared_errors() -> dict[str, type[Exception]]:
    from spconv_train.data import DataError
    from spconv_train.parallel import SpatialShardingError

    return {e.__name__: e for e in (SpatialShardingError, DataError, PredictError)}


#: The errors a rank's failure is re-raised as on every rank (by name; exit code 2); any
#: other failure is a crash (exit code 1).
SHARED_ERRORS = _shared_errors()
