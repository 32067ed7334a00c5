"""Augmentation in global coordinates, applied strip by strip.

The global pipeline for one sample of size ``(H, W)`` is

1. resize by ``scale`` to ``(Hs, Ws) = (round(H*s), round(W*s))`` (image: bilinear with
   antialiasing, exactly as ``torchvision.transforms.v2.functional.resize``; mask: nearest,
   as torchvision does for ``tv_tensors.Mask``);
2. crop a window of the output size at ``(top, left)`` of the resized image; where the
   window leaves the image (crop larger than the image) the image is 0 and the mask
   ``ignore_index``;
3. flip horizontally and/or vertically.

``draw_augment`` draws these parameters from ``(seed, epoch, index)`` alone, so every rank of
a spatial group draws the same ones without communicating, and ``load_strip`` returns
exactly the columns ``[a, b)`` of that globally augmented sample while reading only the
source columns those output columns depend on. Resizing computes every output column's
source taps from the *global* sizes, which is what makes strips agree with the whole.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import SegmentationSource, check_cols

__all__ = ["AugmentParams", "draw_augment", "global_size", "load_strip"]


@dataclass(frozen=True)
class AugmentParams:
    """One sample's augmentation, in global coordinates.

    Attributes:
        source_hw: ``(H, W)`` of the source sample.
        scaled_hw: size after resizing (equal to ``source_hw`` when not resized).
        out_hw: output size (the crop size, or ``source_hw`` when no crop was asked for).
        top, left: position of the output window in the resized image (negative or past
            the end where the window is larger than the image: that part is padding).
        hflip, vflip: flips applied to the output window.
    """

    source_hw: tuple[int, int]
    scaled_hw: tuple[int, int]
    out_hw: tuple[int, int]
    top: int = 0
    left: int = 0
    hflip: bool = False
    vflip: bool = False

    @classmethod
    def identity(cls, image_hw: tuple[int, int]) -> AugmentParams:
        """No augmentation: the sample as stored (for validation and prediction)."""
        hw = (int(image_hw[0]), int(image_hw[1]))
        return cls(source_hw=hw, scaled_hw=hw, out_hw=hw)


def _seed(seed: int, epoch: int, index: int) -> int:
    digest = hashlib.blake2b(f"augment:{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _offset(u: float, slack: int) -> int:
    """Window offset for ``slack = image - window``: in ``[0, slack]`` or ``[slack, 0]``."""
    pick = min(int(u * (abs(slack) + 1)), abs(slack))
    return pick if slack >= 0 else -pick


def draw_augment(
    seed: int,
    epoch: int,
    index: int,
    *,
    image_hw: tuple[int, int],
    crop_hw: tuple[int, int] | None = None,
    hflip: float = 0.0,
    vflip: float = 0.0,
    scale: tuple[float, float] = (1.0, 1.0),
) -> AugmentParams:
    """Draw sample ``index``'s augmentation for ``epoch``; identical on every rank.

    Args:
        seed, epoch, index: hashed into the seed of a local ``torch.Generator``.
        image_hw: ``(H, W)`` of the source sample (``source.size(index)``).
        crop_hw: output size; None keeps the source size (a zoom in or out then crops or
            pads back to it).
        hflip, vflip: flip probabilities.
        scale: ``(lo, hi)``: the resize factor is uniform in this range.
    """
    h, w = (int(v) for v in image_hw)
    lo, hi = (float(v) for v in scale)
    if h < 1 or w < 1:
        raise ValueError(f"image_hw must be positive, got {image_hw}")
    if not 0 < lo <= hi:
        raise ValueError(f"scale must be (lo, hi) with 0 < lo <= hi, got {scale}")
    if not (0.0 <= hflip <= 1.0 and 0.0 <= vflip <= 1.0):
        raise ValueError(f"flip probabilities must be in [0, 1], got {hflip}, {vflip}")
    out_h, out_w = (h, w) if crop_hw is None else (int(crop_hw[0]), int(crop_hw[1]))
    if out_h < 1 or out_w < 1:
        raise ValueError(f"crop_hw must be positive, got {crop_hw}")
    g = torch.Generator().manual_seed(_seed(seed, epoch, index))
    # Always draw the same five numbers so a parameter's value never depends on the others.
    u = torch.rand(5, generator=g, dtype=torch.float64).tolist()
    s = lo + (hi - lo) * u[0]
    scaled = (max(1, round(h * s)), max(1, round(w * s))) if (lo, hi) != (1.0, 1.0) else (h, w)
    return AugmentParams(
        source_hw=(h, w),
        scaled_hw=scaled,
        out_hw=(out_h, out_w),
        top=_offset(u[1], scaled[0] - out_h),
        left=_offset(u[2], scaled[1] - out_w),
        hflip=u[3] < hflip,
        vflip=u[4] < vflip,
    )


def global_size(source: SegmentationSource, index: int, params: AugmentParams) -> tuple[int, int]:
    """``(H, W)`` of sample ``index`` after augmentation with ``params`` (= ``out_hw``)."""
    if tuple(source.size(index)) != tuple(params.source_hw):
        raise ValueError(
            f"{source.name(index)}: augmentation drawn for size {params.source_hw} but the "
            f"sample has size {source.size(index)}"
        )
    return params.out_hw


def _linear_taps(in_size: int, out_size: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """Source indices and weights ``[hi - lo, K]`` of output positions ``[lo, hi)``.

    The antialiased bilinear filter of torch's ``interpolate(..., antialias=True)`` (the
    torchvision default), computed from the global sizes: a triangle of support
    ``max(scale, 1)`` around each output centre, normalized to sum 1. For upsampling this
    equals plain bilinear interpolation with ``align_corners=False``.
    """
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    centre = scale * (torch.arange(lo, hi, dtype=torch.float64) + 0.5)
    first = (centre - support + 0.5).trunc().clamp(min=0)  # C++ int() truncates toward 0
    end = (centre + support + 0.5).trunc().clamp(max=in_size)
    taps = int(math.ceil(support)) * 2 + 1
    idx = first[:, None] + torch.arange(taps, dtype=torch.float64)
    weight = (1.0 - ((idx - centre[:, None] + 0.5) * inv).abs()).clamp(min=0)
    weight = weight * (idx < end[:, None])
    weight = weight / weight.sum(1, keepdim=True).clamp(min=1e-12)
    idx = torch.minimum(idx, end[:, None] - 1)  # unused taps point at a used column
    return idx.long(), weight.float()


def _nearest_taps(in_size: int, out_size: int, lo: int, hi: int) -> Tensor:
    """Source index of output positions ``[lo, hi)`` for torch's ``mode="nearest"``.

    Reproduces torch's float32 arithmetic (``floor(i * (in / out))``) and its special cases,
    so masks match torchvision's resize of a ``tv_tensors.Mask`` exactly.
    """
    i = torch.arange(lo, hi)
    if out_size == in_size:
        return i
    if out_size == 2 * in_size:
        return i // 2
    scale = torch.tensor(float(in_size), dtype=torch.float32) / float(out_size)
    return (i.float() * scale).floor().long().clamp(max=in_size - 1)


def _apply_taps(x: Tensor, idx: Tensor, weight: Tensor, dim: int) -> Tensor:
    """``sum_k x.index_select(dim, idx[:, k]) * weight[:, k]`` along ``dim``.

    A loop over the few taps instead of a gathered ``[..., n, K]`` tensor bounds memory at
    one output-sized buffer; the summation order is the same for every strip.
    """
    shape = [1] * x.dim()
    shape[dim] = -1
    out = x.index_select(dim, idx[:, 0]) * weight[:, 0].view(shape)
    for k in range(1, idx.shape[1]):
        out += x.index_select(dim, idx[:, k]) * weight[:, k].view(shape)
    return out


def _scaled_region(
    source: SegmentationSource,
    index: int,
    params: AugmentParams,
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> tuple[Tensor, Tensor]:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of the resized sample, reading only the
    source rows and columns they depend on (a crop of a tiled TIFF costs the crop)."""
    (h, w), (hs, ws) = params.source_hw, params.scaled_hw
    (r0, r1), (c0, c1) = rows, cols
    if hs == h:
        src_rows = (r0, r1)
    else:
        ridx, rweight = _linear_taps(h, hs, r0, r1)
        rnidx = _nearest_taps(h, hs, r0, r1)
        src_rows = (int(min(ridx.min(), rnidx.min())), int(max(ridx.max(), rnidx.max())) + 1)
    # Full height: the two-argument call, which every source (old subclasses too) accepts.
    extra = () if src_rows == (0, h) else (src_rows,)
    if ws == w:
        image, mask = source.load(index, (c0, c1), *extra)
    else:
        idx, weight = _linear_taps(w, ws, c0, c1)
        nidx = _nearest_taps(w, ws, c0, c1)
        lo = int(min(idx.min(), nidx.min()))
        hi = int(max(idx.max(), nidx.max())) + 1
        image, mask = source.load(index, (lo, hi), *extra)
        image = _apply_taps(image, idx - lo, weight, dim=2)
        mask = mask[:, nidx - lo]
    if hs == h:
        return image, mask
    top = src_rows[0]
    return _apply_taps(image, ridx - top, rweight, dim=1), mask[rnidx - top]


def load_strip(
    source: SegmentationSource,
    index: int,
    cols: tuple[int, int],
    params: AugmentParams,
    *,
    ignore_index: int | None = None,
    rows: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Columns ``[a, b)`` (and rows ``rows``: an H x W tile) of sample ``index`` augmented
    with ``params``.

    Equal to augmenting the whole sample and slicing, for any split of the columns and rows.
    Without resizing only the needed source columns are read; with resizing, the source
    columns the output columns' filter taps touch.

    Args:
        source: the data source.
        index: sample index in ``source``.
        cols: ``(a, b)`` in output (augmented) coordinates, ``0 <= a <= b <= out_w``.
        params: from ``draw_augment`` (or ``AugmentParams.identity``).
        ignore_index: mask value for padding; default ``source.ignore_index``.
        rows: ``(r, s)`` in output coordinates (None: every row).

    Returns:
        image float32 ``[C, s - r, b - a]`` and mask int64 ``[s - r, b - a]``.
    """
    out_h, out_w = global_size(source, index, params)
    a, b = check_cols(cols, out_w, source.name(index))
    ra, rb = check_cols(rows, out_h, f"{source.name(index)} (rows)")
    pad = source.ignore_index if ignore_index is None else ignore_index
    hs, ws = params.scaled_hw
    # Output column j shows window column out_w-1-j when flipped: [a, b) -> [out_w-b, out_w-a).
    ca, cb = (out_w - b, out_w - a) if params.hflip else (a, b)
    ta, tb = (out_h - rb, out_h - ra) if params.vflip else (ra, rb)  # the same for rows
    # The part of the window that lies on the resized image (the rest is padding).
    s0, s1 = max(params.left + ca, 0), min(params.left + cb, ws)
    r0, r1 = max(params.top + ta, 0), min(params.top + tb, hs)
    image = torch.zeros(source.channels(index), rb - ra, b - a)
    mask = torch.full((rb - ra, b - a), pad, dtype=torch.int64)
    if s0 < s1 and r0 < r1:
        part_image, part_mask = _scaled_region(source, index, params, (r0, r1), (s0, s1))
        y, x = r0 - params.top - ta, s0 - params.left - ca
        image[:, y : y + r1 - r0, x : x + s1 - s0] = part_image
        mask[y : y + r1 - r0, x : x + s1 - s0] = part_mask
    if params.hflip:
        image, mask = image.flip(-1), mask.flip(-1)
    if params.vflip:
        image, mask = image.flip(-2), mask.flip(-2)
    return image.contiguous(), mask.contiguous()
