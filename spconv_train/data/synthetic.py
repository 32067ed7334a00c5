"""Deterministic synthetic segmentation data.

Each sample is background (class 0) with textured shapes on it and long horizontal
bands over them. Classes ``1 .. num_classes-2`` are shapes (ellipse, rectangle, bar, ring,
triangle, cycling) with a fixed colour and sinusoidal texture per class. The last class,
``long_band``, needs context wider than one strip: long bands (60-95 % of the width) and
short decoy bands (10-30 %) look identical, and the decoys are labelled background. A rank
that sees only the middle of a band cannot tell which it is without its neighbours.

Everything is drawn from a local ``torch.Generator`` seeded from ``(seed, index)``, so a
sample is the same on every rank and every run, and the global RNG is never touched.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

__all__ = ["synthetic_class_names", "synthetic_sample", "write_synthetic_dataset"]

_SHAPES = ("ellipse", "rectangle", "bar", "ring", "triangle")


def _mix(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def synthetic_class_names(num_classes: int) -> list[str]:
    """Names of the synthetic classes: background, the shape kinds, then ``long_band``."""
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 for synthetic data, got {num_classes}")
    names = ["background"]
    for k in range(num_classes - 2):
        kind = _SHAPES[k % len(_SHAPES)]
        names.append(kind if k < len(_SHAPES) else f"{kind}_{k // len(_SHAPES) + 1}")
    return [*names, "long_band"]


def _looks(num_looks: int, channels: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-class appearance: colour [L, C], texture direction [L, 2], period [L], amplitude [L].

    Fixed per class id (not per sample) so a class looks the same in every image.
    """
    g = torch.Generator().manual_seed(_mix("synthetic-looks", channels))
    background = 0.45 + 0.1 * torch.rand(channels, generator=g)  # mid grey-ish
    # Every class differs from the background by >= 0.175 in each channel, in a random
    # direction, so shapes are visible but classes still overlap in single channels.
    sign = torch.where(torch.rand(num_looks, channels, generator=g) < 0.5, -1.0, 1.0)
    offset = 0.35 * sign * (0.5 + 0.5 * torch.rand(num_looks, channels, generator=g))
    colour = (background + offset).clamp(0.05, 0.95)
    colour[0] = background
    angle = math.pi * torch.rand(num_looks, generator=g)
    direction = torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)
    period = 3.0 + 9.0 * torch.rand(num_looks, generator=g)
    amplitude = 0.06 + 0.12 * torch.rand(num_looks, generator=g)
    amplitude[0] = 0.03
    return colour, direction, period, amplitude


def _uniform(g: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=g, dtype=torch.float64))


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in ``[lo, hi]`` (inclusive)."""
    return int(torch.randint(lo, hi + 1, (), generator=g))


def _shape_region(kind: str, g: torch.Generator, yy: Tensor, xx: Tensor) -> Tensor:
    """Boolean [H, W] region of one random shape of ``kind``, evaluated on the whole grid."""
    h, w = yy.shape[0], xx.shape[1]
    s = float(min(h, w))
    cy, cx = _uniform(g, 0, h), _uniform(g, 0, w)
    theta = _uniform(g, 0, math.pi)
    c, sn = math.cos(theta), math.sin(theta)
    # Coordinates in the shape's rotated frame.
    u = (xx - cx) * c + (yy - cy) * sn
    v = -(xx - cx) * sn + (yy - cy) * c
    if kind == "ellipse":
        rx, ry = (max(1.5, _uniform(g, 0.08, 0.25) * s) for _ in range(2))
        return (u / rx) ** 2 + (v / ry) ** 2 <= 1.0
    if kind == "rectangle":
        hw, hh = (max(1.5, _uniform(g, 0.06, 0.22) * s) for _ in range(2))
        return ((xx - cx).abs() <= hw) & ((yy - cy).abs() <= hh)
    if kind == "bar":
        half_len = max(2.0, _uniform(g, 0.2, 0.45) * s)
        half_thick = max(1.0, _uniform(g, 0.03, 0.07) * s)
        return (u.abs() <= half_len) & (v.abs() <= half_thick)
    if kind == "ring":
        r = max(2.0, _uniform(g, 0.1, 0.25) * s)
        d2 = u**2 + v**2
        return (d2 <= r**2) & (d2 >= (0.55 * r) ** 2)
    # triangle: inside all three half-planes of a rotated equilateral triangle
    r = max(2.0, _uniform(g, 0.1, 0.25) * s)
    inside = torch.ones_like(u, dtype=torch.bool)
    for k in range(3):
        a = 2 * math.pi * k / 3
        inside &= u * math.cos(a) + v * math.sin(a) <= 0.5 * r
    return inside


def synthetic_sample(
    index: int,
    *,
    height: int,
    width: int,
    num_classes: int,
    seed: int = 0,
    in_channels: int = 3,
) -> tuple[Tensor, Tensor]:
    """Generate synthetic sample ``index``, identical for identical ``(seed, index)``.

    Returns:
        image float32 ``[in_channels, height, width]`` in ``[0, 1]`` and mask int64
        ``[height, width]`` with values in ``[0, num_classes)``. See the module docstring
        for what the classes are.
    """
    if height < 1 or width < 1 or in_channels < 1:
        raise ValueError(
            f"need height, width, in_channels >= 1, got {height}, {width}, {in_channels}"
        )
    names = synthetic_class_names(num_classes)
    g = torch.Generator().manual_seed(_mix("synthetic-sample", seed, index))
    yy = torch.arange(height, dtype=torch.float32)[:, None]
    xx = torch.arange(width, dtype=torch.float32)[None, :]
    mask = torch.zeros(height, width, dtype=torch.int64)
    look = torch.zeros(height, width, dtype=torch.int64)  # which appearance each pixel gets

    # Shapes first; bands are painted over them so a band is never cut into pieces that
    # would make a long band look short.
    n_shape_classes = num_classes - 2
    if n_shape_classes > 0:
        n_shapes = _randint(g, 2, min(16, 2 + max(2, round(2 * width / height))))
        first = _randint(g, 0, n_shape_classes - 1)
        for j in range(n_shapes):
            cls = 1 + (first + j) % n_shape_classes  # cycling covers classes evenly
            region = _shape_region(_SHAPES[(cls - 1) % len(_SHAPES)], g, yy, xx)
            mask[region] = cls
            look[region] = cls

    # Bands in distinct row slots so a decoy never continues a long band in the same rows.
    band_look, band_cls = num_classes - 1, num_classes - 1
    thick = max(2, round(_uniform(g, 0.03, 0.06) * height))
    slots = max(1, height // (3 * thick))
    n_long = min(slots, _randint(g, 1, 2))
    n_decoy = min(slots - n_long, _randint(g, 1, 3))
    order = torch.randperm(slots, generator=g).tolist()
    for j in range(n_long + n_decoy):
        long = j < n_long
        frac = _uniform(g, 0.6, 0.95) if long else _uniform(g, 0.1, 0.3)
        length = max(1, min(width, round(frac * width)))
        x0 = _randint(g, 0, width - length)
        y0 = min(height - thick, order[j] * 3 * thick + _randint(g, 0, thick))
        rows, cols = slice(max(0, y0), y0 + thick), slice(x0, x0 + length)
        mask[rows, cols] = band_cls if long else 0
        look[rows, cols] = band_look

    # Render: class colour + class texture + smooth illumination + pixel noise.
    colour, direction, period, amplitude = _looks(len(names), in_channels)
    image = colour[look].permute(2, 0, 1)  # [C, H, W]
    phase = (direction[look, 0] * xx + direction[look, 1] * yy) * (2 * math.pi) / period[look]
    sign = torch.where(torch.arange(in_channels) % 2 == 0, 1.0, -0.7)[:, None, None]
    image = image + amplitude[look] * torch.sin(phase) * sign
    coarse = torch.rand(1, in_channels, max(2, height // 16), max(2, width // 16), generator=g)
    smooth = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)[0]
    image = image * _uniform(g, 0.85, 1.1) + 0.12 * (smooth - 0.5)
    image = image + 0.04 * torch.randn(in_channels, height, width, generator=g)
    return image.clamp_(0.0, 1.0).contiguous(), mask


def _write_image(path_stem: Path, image: Tensor, fmt: str) -> Path:
    """Write an image quantized to 8 bits; formats that cannot hold its channels use .npy."""
    data = (image * 255.0).round().to(torch.uint8).numpy()  # [C, H, W]
    channels = data.shape[0]
    if fmt in ("png", "tif") and channels in (1, 3):
        path = path_stem.with_suffix(f".{fmt}")
        pixels = data[0] if channels == 1 else np.ascontiguousarray(data.transpose(1, 2, 0))
        Image.fromarray(pixels).save(path)
        return path
    path = path_stem.with_suffix(".npy")
    np.save(path, data)  # uint8 [C, H, W]
    return path


def write_synthetic_dataset(
    root: str | Path,
    *,
    num_train: int,
    num_val: int,
    height: int,
    width: int,
    num_classes: int,
    seed: int = 0,
    in_channels: int = 3,
    fmt: str = "png",
) -> Path:
    """Write a synthetic dataset in the folder layout ``FolderDataset`` reads.

    Layout: ``images/{train,val}/NNNN.<ext>``, ``masks/{train,val}/NNNN.png`` (8-bit 'L'
    PNG of class indices) and ``classes.txt`` (one class name per line). Train samples are
    synthetic indices ``0 .. num_train-1``, val samples ``num_train ..`` (so
    ``SyntheticDataset(num_val, offset=num_train)`` is the val set before quantization).

    Images are quantized to 8 bits. ``fmt`` is ``"png"`` or ``"tif"`` (1-channel 'L' or
    3-channel 'RGB') or ``"npy"`` (uint8 ``[C, H, W]``); images whose channel count is not
    1 or 3 are always written as ``.npy``.

    Returns:
        the root path.
    """
    if fmt not in ("png", "tif", "npy"):
        raise ValueError(f"fmt must be 'png', 'tif' or 'npy', got {fmt!r}")
    if num_classes > 255:
        raise ValueError(f"num_classes={num_classes} does not fit an 8-bit mask with ignore 255")
    root = Path(root)
    for split, count, offset in (("train", num_train, 0), ("val", num_val, num_train)):
        img_dir, mask_dir = root / "images" / split, root / "masks" / split
        img_dir.mkdir(parents=True, exist_ok=True)
        mask_dir.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image, mask = synthetic_sample(
                offset + i,
                height=height,
                width=width,
                num_classes=num_classes,
                seed=seed,
                in_channels=in_channels,
            )
            _write_image(img_dir / f"{i:04d}", image, fmt)
            Image.fromarray(mask.to(torch.uint8).numpy()).save(mask_dir / f"{i:04d}.png")
    (root / "classes.txt").write_text("\n".join(synthetic_class_names(num_classes)) + "\n")
    return root
