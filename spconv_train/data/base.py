"""The interface every segmentation data source offers to the trainer.

A source is an indexed collection of (image, mask) pairs that can report a sample's size
without decoding it and load any column range ``[a, b)`` of it. Spatially parallel ranks
each load only their own columns, so ``load(i, cols)`` is the one place pixels are read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

__all__ = ["DataError", "SegmentationSource", "bad_file", "check_cols"]


class DataError(Exception):
    """A data file is missing, unreadable or inconsistent; the message names the file.

    Attributes:
        path: the offending file (or folder), when there is one.
        reason: the message without the file name.
    """

    def __init__(self, message: str, *, path: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.path = path
        if reason is None:  # "the message without the file name": drop a "<path>: " prefix
            prefix = f"{path}: "
            reason = message[len(prefix) :] if path and message.startswith(prefix) else message
        self.reason = reason


def bad_file(path: object, reason: str) -> DataError:
    """A ``DataError`` whose message is ``"<path>: <reason>"``."""
    return DataError(f"{path}: {reason}", path=str(path), reason=reason)


def check_cols(cols: tuple[int, int] | None, width: int, what: str) -> tuple[int, int]:
    """Resolve ``cols`` (None = whole width) and check ``0 <= a <= b <= width``.

    Args:
        cols: half-open column range ``(a, b)`` or None.
        width: the width the range must fit in.
        what: a name for the error message (a file or sample name).
    """
    if cols is None:
        return 0, width
    a, b = (int(c) for c in cols)
    if not 0 <= a <= b <= width:
        raise ValueError(f"{what}: column range [{a}, {b}) is outside [0, {width})")
    return a, b


def check_one_size(
    source, indices, sizes: list[tuple[int, ...]], what: str, axes: str, fix: str
) -> None:
    """Raise ``DataError`` listing every sample's name and size when ``sizes`` (one per
    index of ``source``) differ: one batch stacks them. ``what`` names the samples,
    ``axes`` their size's axes, ``fix`` the way out."""
    if len(set(sizes)) > 1:
        listed = ", ".join(
            f"{source.name(i)} {'x'.join(map(str, s))}" for i, s in zip(indices, sizes, strict=True)
        )
        raise DataError(f"{what} in one batch must have the same size {axes}: {listed}; {fix}")


class SegmentationSource(ABC):
    """An indexed set of segmentation samples readable column range by column range.

    Attributes:
        num_classes: number of classes; mask values are in ``[0, num_classes)`` or
            equal to ``ignore_index``.
        ignore_index: mask value that marks pixels excluded from the loss.
    """

    num_classes: int
    ignore_index: int = 255

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def size(self, i: int) -> tuple[int, int]:
        """``(H, W)`` of sample ``i``, read without decoding pixels where possible."""

    @abstractmethod
    def load(
        self, i: int, cols: tuple[int, int] | None = None, rows: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rows ``[r0, r1)`` x columns ``[a, b)`` of sample ``i`` (None = all).

        Returns:
            image float32 ``[C, r1 - r0, b - a]`` (normalised) and mask int64
            ``[r1 - r0, b - a]``.
        """

    @abstractmethod
    def name(self, i: int) -> str:
        """A human-readable name of sample ``i`` (file stem or synthetic id) for messages."""

    @abstractmethod
    def channels(self, i: int) -> int:
        """Number of image channels of sample ``i``."""

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        """The whole sample ``i`` (convenience for single-device use)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        return self.load(i % len(self))
