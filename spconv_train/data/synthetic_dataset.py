"""``SyntheticDataset``: generated samples behind the ``SegmentationSource`` interface."""

from __future__ import annotations

from torch import Tensor

from .base import SegmentationSource, check_cols
from .synthetic import synthetic_class_names, synthetic_sample

__all__ = ["SyntheticDataset"]


class SyntheticDataset(SegmentationSource):
    """``n`` synthetic samples ``offset .. offset+n-1`` behind the ``SegmentationSource`` API.

    ``load`` generates the whole sample and slices the columns (generation is cheap).
    """

    def __init__(
        self,
        n: int,
        *,
        height: int,
        width: int,
        num_classes: int,
        seed: int = 0,
        in_channels: int = 3,
        offset: int = 0,
        ignore_index: int = 255,
    ) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n, self.height, self.width = n, height, width
        self.num_classes, self.seed, self.in_channels = num_classes, seed, in_channels
        self.offset, self.ignore_index = offset, ignore_index
        self.class_names = synthetic_class_names(num_classes)

    def __len__(self) -> int:
        return self.n

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"sample index {i} out of range for {self.n} synthetic samples")

    def size(self, i: int) -> tuple[int, int]:
        """``(height, width)``; all synthetic samples have the same size."""
        self._check(i)
        return self.height, self.width

    def channels(self, i: int) -> int:
        """``in_channels``."""
        self._check(i)
        return self.in_channels

    def name(self, i: int) -> str:
        """``synthetic[seed=S]/NNNN`` with the global synthetic index."""
        return f"synthetic[seed={self.seed}]/{self.offset + i:04d}"

    def load(
        self, i: int, cols: tuple[int, int] | None = None, rows: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Generate sample ``offset + i`` and return rows x columns ``[a, b)`` (None = all)."""
        self._check(i)
        a, b = check_cols(cols, self.width, self.name(i))
        image, mask = synthetic_sample(
            self.offset + i,
            height=self.height,
            width=self.width,
            num_classes=self.num_classes,
            seed=self.seed,
            in_channels=self.in_channels,
        )
        r0, r1 = (0, self.height) if rows is None else rows
        return image[:, r0:r1, a:b].contiguous(), mask[r0:r1, a:b].contiguous()
