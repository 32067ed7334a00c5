"""``data.augment``: declared transforms on top of the crop, exact on every layout.

A sample's plan is the crop / resize / flip of ``transforms.draw_augment`` followed by the
``data.augment`` list: geometric transforms (rot90, transpose, affine, elastic) in list
order, then the point-wise ones (brightness, contrast, gamma, noise) in list order. The
numbers are drawn from ``(seed, epoch, index)`` alone, so every rank draws the same plan.

``load_plan_part`` returns rows x columns of the planned sample without the whole crop:
the rank maps its output pixels back through the geometric transforms (``augment_ops``),
reads only the crop box they fall in (via ``transforms.load_strip``, which itself reads
only the needed source region) and resamples there. rot90 and transpose by an odd number
of swaps draw a crop of the swapped size, so the output keeps ``(data.height,
data.width)``. Which transforms need a margin: affine and elastic read one pixel around
the bounding box of their source positions (the bilinear taps); rot90 and transpose read
exactly their source pixels; the point-wise ones read nothing extra.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .augment_ops import DrawnOp, apply_intensity, backward_map, resample, source_box
from .augment_spec import GEOMETRIC, INTENSITY, AugmentSpec
from .base import SegmentationSource, check_cols, check_one_size
from .normalize import _cfg
from .strips import make_batch
from .transforms import AugmentParams, draw_augment, load_strip

__all__ = ["AugmentPlan", "draw_plan", "load_plan_part", "make_plan_batch", "value_range"]

_DRAWS = 5  # numbers drawn per declared transform, used or not (independent parameters)


@dataclass(frozen=True)
class AugmentPlan:
    """One sample's augmentation: ``base`` (crop, resize, flips), then ``ops``.

    Attributes:
        base: crop / resize / flips from ``draw_augment``; ``base.out_hw`` is the crop.
        ops: the transforms drawn to apply (skipped ones left out), in application order.
        out_hw: the final size.
    """

    base: AugmentParams
    ops: tuple[DrawnOp, ...] = ()
    out_hw: tuple[int, int] = (0, 0)

    @property
    def geometric(self) -> list[DrawnOp]:
        """The transforms that move pixels."""
        return [op for op in self.ops if op.name in GEOMETRIC]

    @property
    def intensity(self) -> list[DrawnOp]:
        """The point-wise transforms."""
        return [op for op in self.ops if op.name in INTENSITY]


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _lerp(lo_hi: tuple[float, float], u: float) -> float:
    return lo_hi[0] + (lo_hi[1] - lo_hi[0]) * u


def _values(spec: AugmentSpec, u: list[float], hw: tuple[int, int]) -> tuple[float, ...]:
    """The drawn parameters of ``spec`` for an input of size ``hw`` from uniforms ``u``."""
    if spec.name == "rot90":
        ks = spec.arg("k")
        return (float(ks[min(int(u[0] * len(ks)), len(ks) - 1)]),)
    if spec.name == "transpose":
        return ()
    if spec.name == "affine":
        fx, fy = spec.arg("translate")
        # Whole-pixel shifts, as torchvision's RandomAffine draws them.
        tx = float(round(_lerp((-fx * hw[1], fx * hw[1]), u[1])))
        ty = float(round(_lerp((-fy * hw[0], fy * hw[0]), u[2])))
        angle, shear = _lerp(spec.arg("degrees"), u[0]), _lerp(spec.arg("shear"), u[4])
        return (angle, tx, ty, _lerp(spec.arg("scale"), u[3]), shear)
    if spec.name == "elastic":
        return (spec.arg("alpha"), spec.arg("sigma"))
    key = {"brightness": "factor", "contrast": "factor", "gamma": "gamma", "noise": "sigma"}
    return (_lerp(spec.arg(key[spec.name]), u[0]),)


def draw_plan(
    seed: int,
    epoch: int,
    index: int,
    *,
    image_hw: tuple[int, int],
    crop_hw: tuple[int, int] | None,
    specs: list[AugmentSpec],
    hflip: float = 0.0,
    vflip: float = 0.0,
    scale: tuple[float, float] = (1.0, 1.0),
    recentre: Callable[[AugmentParams], AugmentParams] | None = None,
) -> AugmentPlan:
    """Sample ``index``'s plan for ``epoch``: identical on every rank.

    Args:
        seed, epoch, index: what the numbers are drawn from.
        image_hw: the source sample's size.
        crop_hw: the final output size (None: the resized image's size, swapped by an odd
            number of rot90 / transpose swaps).
        specs: ``parse_augment(data.augment)``.
        hflip, vflip, scale: as ``draw_augment``.
        recentre: moves the crop window (class oversampling: ``ClassSampler.recentre``).
    """
    g = torch.Generator().manual_seed(_seed("augment-v2", seed, epoch, index))
    draws = [torch.rand(_DRAWS + 1, generator=g, dtype=torch.float64).tolist() for _ in specs]
    applied = [(s, u[1:], i) for i, (s, u) in enumerate(zip(specs, draws, strict=True))
               if u[0] < s.p]  # fmt: skip
    swaps = 0
    for spec, u, _ in applied:
        swaps += spec.name == "transpose" or (
            spec.name == "rot90" and _values(spec, u, (1, 1))[0] % 2
        )
    base_crop = crop_hw
    if crop_hw is not None and swaps % 2:
        base_crop = (crop_hw[1], crop_hw[0])
    base = draw_augment(
        seed, epoch, index, image_hw=image_hw, crop_hw=base_crop, hflip=hflip, vflip=vflip,
        scale=scale,
    )  # fmt: skip
    if recentre is not None:
        base = recentre(base)
    ops, hw = [], base.out_hw
    for spec, u, i in applied:
        op = DrawnOp(spec.name, _values(spec, u, hw), hw, _seed("op", seed, epoch, index, i))
        ops.append(op)
        hw = op.out_hw
    # Geometry first, then the point-wise transforms (each group in list order).
    ordered = [op for op in ops if op.name in GEOMETRIC] + [
        op for op in ops if op.name in INTENSITY
    ]
    return AugmentPlan(base=base, ops=tuple(ordered), out_hw=hw)


def value_range(normalize: object, channels: int) -> tuple[Tensor, Tensor]:
    """Per-channel ``(low, high)`` of the normalised values that the storage range maps to:
    ``[0, 1]``, or for ``data.normalize.mode: mean_std`` ``[(0 - mean) / std,
    (1 - mean) / std]``. Point-wise transforms work on this scale."""
    low, high = torch.zeros(channels), torch.ones(channels)
    if _cfg(normalize or {}, "mode", "dtype") == "mean_std":
        mean = torch.tensor(_cfg(normalize, "mean"), dtype=torch.float32).expand(channels)
        std = torch.tensor(_cfg(normalize, "std"), dtype=torch.float32).expand(channels)
        low, high = (low - mean) / std, (high - mean) / std
    return low, high


def load_plan_part(
    source: SegmentationSource,
    index: int,
    plan: AugmentPlan,
    cols: tuple[int, int],
    *,
    rows: tuple[int, int] | None = None,
    ignore_index: int | None = None,
    values: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Rows ``rows`` (None: all) x columns ``cols`` of sample ``index`` augmented by
    ``plan``: equal to augmenting the whole crop and slicing, for any strip or tile.

    Args:
        values: ``value_range`` for the point-wise transforms (default ``[0, 1]``).

    Returns:
        image float32 ``[C, h, w]`` and mask int64 ``[h, w]``.
    """
    name = source.name(index)
    out_h, out_w = plan.out_hw
    cols = check_cols(cols, out_w, name)
    rows = check_cols(rows, out_h, f"{name} (rows)")
    fill = source.ignore_index if ignore_index is None else ignore_index
    geometric = plan.geometric
    if not geometric:
        image, mask = load_strip(source, index, cols, plan.base, ignore_index=fill, rows=rows)
    else:
        y, x = backward_map(geometric, rows, cols)
        crop_hw = plan.base.out_hw
        box = source_box(y, x, crop_hw)
        if box is None:  # every pixel maps outside the crop
            image = torch.zeros(source.channels(index), *y.shape)
            mask = torch.full(tuple(y.shape), fill, dtype=torch.int64)
        else:
            (r0, r1), (c0, c1) = box
            part = load_strip(source, index, (c0, c1), plan.base, ignore_index=fill, rows=(r0, r1))
            image, mask = resample(*part, (r0, c0), y, x, crop_hw, fill)
    if plan.intensity:
        values = values or (torch.zeros(image.shape[0]), torch.ones(image.shape[0]))
        image = apply_intensity(image, plan.intensity, values, rows, cols, plan.out_hw)
    return image.contiguous(), mask.contiguous()


def make_plan_batch(
    source: SegmentationSource,
    indices: list[int],
    plans: list[AugmentPlan],
    cols: tuple[int, int],
    *,
    rows: tuple[int, int] | None = None,
    ignore_index: int | None = None,
    values: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Stack this rank's parts of the planned samples (``strips.make_batch`` with plans).

    Raises ``DataError`` naming the samples when their final sizes differ.
    """
    if not any(p.ops for p in plans):  # crop, resize and flips only
        base = [p.base for p in plans]
        return make_batch(source, indices, cols, base, ignore_index=ignore_index, rows=rows)
    what = "samples", "after augmentation (HxW)"
    fix = "set data.height and data.width or use batch size 1"
    check_one_size(source, indices, [p.out_hw for p in plans], *what, fix)
    parts = [
        load_plan_part(source, i, p, cols, rows=rows, ignore_index=ignore_index, values=values)
        for i, p in zip(indices, plans, strict=True)
    ]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
