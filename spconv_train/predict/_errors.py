"""The errors of ``spconv-train predict`` (exit code 2)."""

from __future__ import annotations

__all__ = ["ImagesFailed", "PredictError"]  # and SHARED_ERRORS, built on first use (below)


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


def __getattr__(name: str) -> dict[str, type[Exception]]:
    """``SHARED_ERRORS``: the errors a rank's failure is re-raised as on every rank (by name;
    exit code 2); any other failure is a crash (exit code 1). Built on first use: it imports
    ``spconv_train.parallel`` (DTensor, Dynamo: seconds of CPU), which ``spconv-train --help``
    and a command that stops before any model is built never need."""
    if name == "SHARED_ERRORS":
        globals()[name] = errors = _shared_errors()
        return errors
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
