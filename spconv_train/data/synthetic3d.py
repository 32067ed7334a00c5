"""Deterministic synthetic 3-D segmentation volumes (the volume twin of ``synthetic.py``).

Each volume is background (class 0) with textured blobs (ellipsoid, box, shell, cycling
over classes ``1 .. num_classes-2``) and straight rods painted over them, each along a
random axis (D, H or W). The last class, ``long_band``, needs context wider than one
block whichever dimension is split: long rods (60-95 % of the extent along their axis)
and short decoy rods (10-30 %) look identical, and the decoys are labelled background. A
rank that sees only part of a rod cannot tell which it is without its neighbours.

Colours, textures and class names are those of the 2-D generator; everything is drawn
from a local generator seeded from ``(seed, index)``, so a volume is the same on every
rank and every run.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .synthetic import _looks, _mix, _randint, _uniform, synthetic_class_names

__all__ = ["synthetic_volume", "synthetic_volume_class_names", "write_synthetic_volumes"]

_BLOBS = ("ellipsoid", "box", "shell")


def synthetic_volume_class_names(num_classes: int) -> list[str]:
    """Names of the synthetic volume classes: background, the blob kinds, ``long_band``."""
    names = synthetic_class_names(num_classes)  # checks num_classes >= 2
    blobs = [_BLOBS[k % len(_BLOBS)] for k in range(num_classes - 2)]
    blobs = [b if k < len(_BLOBS) else f"{b}_{k // len(_BLOBS) + 1}" for k, b in enumerate(blobs)]
    return [names[0], *blobs, names[-1]]


def _blob(kind: str, g: torch.Generator, grid: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Boolean ``[D, H, W]`` region of one random blob of ``kind`` on the whole grid."""
    zz, yy, xx = grid
    extent = (zz.shape[0], yy.shape[1], xx.shape[2])
    s = float(min(extent))
    centre = [_uniform(g, 0, n) for n in extent]
    rel = [c - m for c, m in zip((zz, yy, xx), centre, strict=True)]
    radii = [max(1.5, _uniform(g, 0.12, 0.3) * s) for _ in range(3)]
    if kind == "box":
        return (rel[0].abs() <= radii[0]) & (rel[1].abs() <= radii[1]) & (rel[2].abs() <= radii[2])
    d2 = sum((r / a) ** 2 for r, a in zip(rel, radii, strict=True))
    return (d2 <= 1.0) & (d2 >= 0.35) if kind == "shell" else d2 <= 1.0


def _rod(g: torch.Generator, extent: tuple[int, int, int], long: bool) -> tuple[slice, ...]:
    """The index box of one rod along a random axis: long (60-95 %) or a decoy (10-30 %)."""
    axis = _randint(g, 0, 2)
    thick = max(2, round(_uniform(g, 0.08, 0.14) * min(extent)))
    box = []
    for k, n in enumerate(extent):
        if k == axis:
            frac = _uniform(g, 0.6, 0.95) if long else _uniform(g, 0.1, 0.3)
            length = max(1, min(n, round(frac * n)))
        else:
            length = min(n, thick)
        start = _randint(g, 0, n - length)
        box.append(slice(start, start + length))
    return tuple(box)


def synthetic_volume(
    index: int,
    *,
    depth: int,
    height: int,
    width: int,
    num_classes: int,
    seed: int = 0,
    in_channels: int = 1,
) -> tuple[Tensor, Tensor]:
    """Generate synthetic volume ``index``, identical for identical ``(seed, index)``.

    Returns:
        image float32 ``[in_channels, depth, height, width]`` in ``[0, 1]`` and mask int64
        ``[depth, height, width]`` with values in ``[0, num_classes)``.
    """
    if min(depth, height, width, in_channels) < 1:
        raise ValueError(
            f"need depth, height, width, in_channels >= 1, got {depth}, {height}, {width}, "
            f"{in_channels}"
        )
    names = synthetic_volume_class_names(num_classes)
    g = torch.Generator().manual_seed(_mix("synthetic-volume", seed, index))
    extent = (depth, height, width)
    grid = (
        torch.arange(depth, dtype=torch.float32)[:, None, None],
        torch.arange(height, dtype=torch.float32)[None, :, None],
        torch.arange(width, dtype=torch.float32)[None, None, :],
    )
    mask = torch.zeros(extent, dtype=torch.int64)
    look = torch.zeros(extent, dtype=torch.int64)
    n_blob_classes = num_classes - 2
    if n_blob_classes > 0:
        first = _randint(g, 0, n_blob_classes - 1)
        for j in range(_randint(g, 2, 5)):
            cls = 1 + (first + j) % n_blob_classes
            region = _blob(_BLOBS[(cls - 1) % len(_BLOBS)], g, grid)
            mask[region], look[region] = cls, cls
    # Decoys first, long rods over them: a long rod is never cut into short-looking pieces.
    band = num_classes - 1
    rods = [False] * _randint(g, 1, 3) + [True] * _randint(g, 1, 2)
    for long in rods:
        box = _rod(g, extent, long)
        mask[box], look[box] = (band if long else 0), band

    colour, _, period, amplitude = _looks(len(names), in_channels)
    theta, phi = _uniform(g, 0, math.pi), _uniform(g, 0, math.pi)
    direction = (math.cos(phi), math.sin(phi) * math.cos(theta), math.sin(phi) * math.sin(theta))
    image = colour[look].permute(3, 0, 1, 2)  # [C, D, H, W]
    along = sum(c * d for c, d in zip(grid, direction, strict=True))
    phase = along * (2 * math.pi) / period[look]
    sign = torch.where(torch.arange(in_channels) % 2 == 0, 1.0, -0.7)[:, None, None, None]
    image = image + amplitude[look] * torch.sin(phase) * sign
    coarse = torch.rand(1, in_channels, *(max(2, n // 8) for n in extent), generator=g)
    smooth = F.interpolate(coarse, size=extent, mode="trilinear", align_corners=False)[0]
    image = image * _uniform(g, 0.85, 1.1) + 0.12 * (smooth - 0.5)
    image = image + 0.04 * torch.randn(in_channels, *extent, generator=g)
    return image.clamp_(0.0, 1.0).contiguous(), mask


def write_synthetic_volumes(
    root: str | Path,
    *,
    num_train: int,
    num_val: int,
    size: tuple[int, int, int],
    num_classes: int,
    seed: int = 0,
    in_channels: int = 1,
) -> Path:
    """Write synthetic volumes in the layout ``VolumeFolder`` reads: ``images/{split}/NNNN.npy``
    (uint8 ``[D, H, W]``, or ``[C, D, H, W]`` for several channels), ``masks/{split}/NNNN.npy``
    (uint8 ``[D, H, W]``) and ``classes.txt``. Val volumes follow the train ones (as
    ``write_synthetic_dataset`` does for images). Returns the root."""
    root = Path(root)
    depth, height, width = size
    for split, count, offset in (("train", num_train, 0), ("val", num_val, num_train)):
        for sub in ("images", "masks"):
            (root / sub / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image, mask = synthetic_volume(
                offset + i,
                depth=depth,
                height=height,
                width=width,
                num_classes=num_classes,
                seed=seed,
                in_channels=in_channels,
            )
            data = (image * 255.0).round().to(torch.uint8).numpy()
            np.save(root / "images" / split / f"{i:04d}.npy", data[0] if in_channels == 1 else data)
            np.save(root / "masks" / split / f"{i:04d}.npy", mask.to(torch.uint8).numpy())
    (root / "classes.txt").write_text("\n".join(synthetic_volume_class_names(num_classes)) + "\n")
    return root
