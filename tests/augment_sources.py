"""Small in-memory sources for the augmentation and class-sampling tests."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from spconv_train.data.base import SegmentationSource, check_cols


class ArraySource(SegmentationSource):
    """Samples held as arrays: uint16 images ``[C, H, W]`` (loaded / 65535, as
    ``data.normalize.mode: dtype`` does) and uint8 masks ``[H, W]``. Records every region
    ``load`` reads, as ``(index, rows, cols)``."""

    def __init__(self, images: list[np.ndarray], masks: list[np.ndarray], num_classes: int = 4):
        self.images, self.masks, self.num_classes = images, masks, num_classes
        self.reads: list[tuple[int, tuple[int, int], tuple[int, int]]] = []

    def __len__(self) -> int:
        return len(self.images)

    def size(self, i: int) -> tuple[int, int]:
        return tuple(self.masks[i].shape)

    def channels(self, i: int) -> int:
        return self.images[i].shape[0]

    def name(self, i: int) -> str:
        return f"array/{i}"

    def load(self, i, cols=None, rows=None) -> tuple[Tensor, Tensor]:
        h, w = self.size(i)
        a, b = check_cols(cols, w, self.name(i))
        r0, r1 = check_cols(rows, h, self.name(i))
        self.reads.append((i, (r0, r1), (a, b)))
        image = torch.from_numpy(self.images[i][:, r0:r1, a:b].astype(np.float32)) / 65535.0
        return image, torch.from_numpy(self.masks[i][r0:r1, a:b].astype(np.int64))


def random_source(n: int = 3, hw: tuple[int, int] = (40, 52), channels: int = 2, seed: int = 0):
    """``n`` samples of 16-bit noise images and masks of 4 classes in blocks."""
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 65536, (channels, *hw), dtype=np.uint16) for _ in range(n)]
    masks = []
    for _ in range(n):
        coarse = rng.integers(0, 4, (hw[0] // 4 + 1, hw[1] // 4 + 1), dtype=np.uint8)
        masks.append(np.kron(coarse, np.ones((4, 4), np.uint8))[: hw[0], : hw[1]].copy())
    return ArraySource(images, masks)
