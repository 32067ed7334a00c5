"""3-D volumes: the source interface, augmentation in global coordinates, per-rank blocks.

A volume sample is an image ``[C, D, H, W]`` with a class-index mask ``[D, H, W]``. One
spatial dimension (``axis`` 0, 1, 2 = D, H, W), or several, is split across the sp ranks
like DTensor's ``Shard`` (``strip_bounds``); each rank reads only its own block (``[a, b)``
along each axis), through ``VolumeSource.read`` on a box in source coordinates. Crops and
flips are drawn from ``(seed, epoch, index)`` alone, so every rank of a replica draws the
same, and the block of the augmented volume maps back to one box of the stored one (a flip
mirrors the range).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import DataError, check_one_size
from .synthetic import _mix
from .synthetic3d import synthetic_volume, synthetic_volume_class_names

__all__ = [
    "AXES",
    "Box",
    "SyntheticVolumes",
    "VolumeAugment",
    "VolumeSource",
    "draw_volume_augment",
    "load_block",
    "load_box",
    "make_volume_batch",
]

AXES = ("D", "H", "W")
"""Spatial axes of a volume (tensor dim ``2 + index``); ``parallel.shard_dim`` names one."""

Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
"""Half-open ``(start, stop)`` ranges along D, H, W."""


class VolumeSource(ABC):
    """An indexed set of segmentation volumes readable box by box.

    Attributes:
        num_classes: number of classes.
        ignore_index: mask value that marks voxels excluded from the loss.
    """

    num_classes: int
    ignore_index: int = 255

    @abstractmethod
    def __len__(self) -> int:
        """Number of volumes."""

    @abstractmethod
    def size(self, i: int) -> tuple[int, int, int]:
        """``(D, H, W)`` of volume ``i`` (from the file header where there is one)."""

    @abstractmethod
    def channels(self, i: int) -> int:
        """Number of image channels of volume ``i``."""

    @abstractmethod
    def name(self, i: int) -> str:
        """A human-readable name of volume ``i`` for messages."""

    @abstractmethod
    def read(self, i: int, box: Box) -> tuple[Tensor, Tensor]:
        """The box of volume ``i``: image float32 ``[C, d, h, w]`` (normalised) and mask
        int64 ``[d, h, w]``."""

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        """The whole volume ``i`` (convenience for single-device use)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"volume index {i} out of range for {len(self)} volumes")
        i %= len(self)
        return self.read(i, tuple((0, n) for n in self.size(i)))  # type: ignore[arg-type]


@dataclass(frozen=True)
class VolumeAugment:
    """One volume's crop and flips, in global coordinates.

    Attributes:
        start: corner of the output window in the stored volume (D, H, W).
        out: output size (D, H, W).
        flips: whether the window is mirrored along D, H, W (only H and W are drawn).
    """

    start: tuple[int, int, int]
    out: tuple[int, int, int]
    flips: tuple[bool, bool, bool] = (False, False, False)

    @classmethod
    def identity(cls, size: tuple[int, int, int]) -> VolumeAugment:
        """The volume as stored (validation)."""
        return cls((0, 0, 0), tuple(int(n) for n in size))  # type: ignore[arg-type]


def draw_volume_augment(
    seed: int,
    epoch: int,
    index: int,
    *,
    size: tuple[int, int, int],
    crop: tuple[int | None, int | None, int | None],
    hflip: float = 0.0,
    vflip: float = 0.0,
    name: str = "volume",
) -> VolumeAugment:
    """A random crop of ``crop`` (None: the whole extent) and flips along W (``hflip``) and
    H (``vflip``), from ``(seed, epoch, index)`` only. A crop larger than the volume fails
    naming it (volumes are not padded)."""
    g = torch.Generator().manual_seed(_mix("volume-augment", seed, epoch, index))
    out = tuple(n if c is None else int(c) for n, c in zip(size, crop, strict=True))
    too_big = [f"{a}={c} > {n}" for a, c, n in zip(AXES, out, size, strict=True) if c > n]
    if too_big:
        raise DataError(
            f"{name}: the crop is larger than the volume ({', '.join(too_big)}); set "
            "data.depth/height/width to at most the smallest volume, or null",
            path=name,
        )
    start = tuple(
        int(torch.randint(0, n - c + 1, (), generator=g)) for n, c in zip(size, out, strict=True)
    )
    u = torch.rand(2, generator=g).tolist()
    flips = (False, u[0] < vflip, u[1] < hflip)
    return VolumeAugment(start, out, flips)  # type: ignore[arg-type]


def load_box(source: VolumeSource, i: int, aug: VolumeAugment, block: Box) -> tuple[Tensor, Tensor]:
    """The block ``block`` (``[a, b)`` along D, H, W) of the augmented volume ``i``: image
    ``[C, ...]`` and mask. Reads only the matching box of the stored volume (a flip
    mirrors the range)."""
    box = []
    for (a, b), lo, n, flip in zip(block, aug.start, aug.out, aug.flips, strict=True):
        box.append((lo + n - b, lo + n - a) if flip else (lo + a, lo + b))
    image, mask = source.read(i, tuple(box))  # type: ignore[arg-type]
    dims = [k for k, flip in enumerate(aug.flips) if flip]
    if dims:
        image = image.flip([1 + k for k in dims])
        mask = mask.flip(dims)
    return image.contiguous(), mask.contiguous()


def load_block(
    source: VolumeSource, i: int, aug: VolumeAugment, axis: int, bounds: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Block ``[a, b)`` along ``axis`` (0, 1, 2 = D, H, W) of the augmented volume ``i``
    (the whole extent along the other axes): ``load_box`` of a one-dim split."""
    block = tuple(bounds if k == axis else (0, n) for k, n in enumerate(aug.out))
    return load_box(source, i, aug, block)  # type: ignore[arg-type]


def make_volume_batch(
    source: VolumeSource, indices: list[int], augments: list[VolumeAugment], block: Box
) -> tuple[Tensor, Tensor]:
    """Stack the blocks ``block`` (ranges along D, H, W, ``load_box``) of volumes
    ``indices``; they must have one augmented size.

    Returns:
        images float32 ``[B, C, d, h, w]`` and masks int64 ``[B, d, h, w]``.
    """
    fix = "set a crop size (data.depth/height/width) or use batch size 1"
    check_one_size(source, indices, [a.out for a in augments], "volumes", "(DxHxW)", fix)
    pairs = zip(indices, augments, strict=True)
    blocks = [load_box(source, i, a, block) for i, a in pairs]
    return torch.stack([b[0] for b in blocks]), torch.stack([b[1] for b in blocks])


class SyntheticVolumes(VolumeSource):
    """``n`` synthetic volumes ``offset .. offset+n-1`` (``synthetic_volume``); ``read``
    generates the whole volume and slices the box (generation is cheap at these sizes)."""

    def __init__(
        self,
        n: int,
        *,
        size: tuple[int, int, int],
        num_classes: int,
        seed: int = 0,
        in_channels: int = 1,
        offset: int = 0,
        ignore_index: int = 255,
    ) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n, self.shape, self.num_classes = n, tuple(size), num_classes
        self.seed, self.in_channels, self.offset = seed, in_channels, offset
        self.ignore_index = ignore_index
        self.class_names = synthetic_volume_class_names(num_classes)

    def __len__(self) -> int:
        return self.n

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"volume index {i} out of range for {self.n} synthetic volumes")

    def size(self, i: int) -> tuple[int, int, int]:
        """The configured ``(depth, height, width)``."""
        self._check(i)
        return self.shape  # type: ignore[return-value]

    def channels(self, i: int) -> int:
        """``in_channels``."""
        self._check(i)
        return self.in_channels

    def name(self, i: int) -> str:
        """``synthetic-volume[seed=S]/NNNN`` with the global synthetic index."""
        return f"synthetic-volume[seed={self.seed}]/{self.offset + i:04d}"

    def read(self, i: int, box: Box) -> tuple[Tensor, Tensor]:
        """Generate volume ``offset + i`` and return ``box`` of it."""
        self._check(i)
        d, h, w = self.shape
        image, mask = synthetic_volume(
            self.offset + i,
            depth=d,
            height=h,
            width=w,
            num_classes=self.num_classes,
            seed=self.seed,
            in_channels=self.in_channels,
        )
        s = tuple(slice(a, b) for a, b in box)
        return image[(slice(None), *s)].contiguous(), mask[s].contiguous()
