"""The arithmetic of a sharded resize (``_interpolate.py`` holds the op): output sizes,
per-dimension source tables and the plan of which input columns each rank reads.

Resizing part by part is only right if every output column takes its source coordinate from
the *global* sizes: ``F.interpolate`` on a strip would use the strip's width and shift every
coordinate. So a resize is written as an index table plus weights per dimension, computed
from the global sizes with PyTorch's own arithmetic (ATen ``UpSample.h``:
``area_pixel_compute_scale``, ``nearest_idx``, ``compute_source_index_and_lambda``, in the
same float precision and with the same special cases), and applied with ``index_select``
(nearest) or two ``index_select`` and a weighted sum (linear, the same 1-D table for
"linear", "bilinear" and "trilinear": they are separable).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._geometry import ExchangePlan, Interval, SpatialShardingError, all_shard_bounds


def _per_dim(v, n: int, name: str, what: str) -> tuple:
    """``v`` (a number or a sequence) as one value per spatial dim."""
    out = tuple(v) if isinstance(v, (list, tuple)) else (v,) * n
    if len(out) != n:
        raise ValueError(f"{what}: {name} {v} must give {n} values, one per spatial dim")
    return out


def resize_sizes(
    in_sizes: tuple[int, ...],
    size,
    scale_factor,
    mode: str,
    align_corners: bool | None,
    recompute_scale_factor: bool | None,
    what: str = "interpolate",
) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
    """Output spatial sizes and the scales ATen receives, following ``F.interpolate``'s
    rules for any number of spatial dims: a ``scale_factor`` (unless
    ``recompute_scale_factor``) gives ``floor(in * scale)`` and is passed on, so the
    coordinate map uses ``1 / scale_factor`` rather than ``in / out``."""
    n = len(in_sizes)
    if mode in ("nearest", "nearest-exact", "area") and align_corners is not None:
        raise ValueError(
            "align_corners option can only be set with the interpolating modes: "
            "linear | bilinear | bicubic | trilinear"
        )
    if (size is None) == (scale_factor is None):
        raise ValueError("exactly one of size or scale_factor should be defined")
    if size is not None:
        if recompute_scale_factor:
            raise ValueError("recompute_scale_factor is not meaningful with an explicit size.")
        return tuple(int(o) for o in _per_dim(size, n, "size", what)), (None,) * n
    sf = tuple(float(f) for f in _per_dim(scale_factor, n, "scale_factor", what))
    out = tuple(math.floor(i * f) for i, f in zip(in_sizes, sf, strict=True))
    return out, ((None,) * n if recompute_scale_factor else sf)


def _ratio(size_in: int, size_out: int, scale: float | None, dtype: torch.dtype) -> Tensor:
    """ATen ``compute_scales_value``: ``1/scale`` when a scale was given, else in/out."""
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=dtype)
    return torch.tensor(size_in, dtype=dtype) / torch.tensor(size_out, dtype=dtype)


@functools.lru_cache(maxsize=256)
def resize_table(
    mode: str,
    size_in: int,
    size_out: int,
    align_corners: bool,
    scale: float | None,
    double: bool = False,
) -> tuple[Tensor, ...]:
    """Global source table of one resized dimension, exactly as ATen's CPU kernel builds it.

    "nearest"/"nearest-exact": ``(index,)``. "bilinear": ``(i0, i1, w0, w1)`` with output
    ``j = w0[j] * x[i0[j]] + w1[j] * x[i1[j]]``. ``double``: the input is float64, for which
    ATen computes scales and weights in float64 (float32 otherwise). Indices are
    non-decreasing in ``j``.
    """
    j = torch.arange(size_out, dtype=torch.int64)
    last = size_in - 1
    opm = torch.float64 if double else torch.float32
    if mode in ("nearest", "nearest-exact"):
        # nearest_idx: two special cases, then floorf(j * scale) (nearest-exact:
        # floorf((j + 0.5) * scale)); the scale and product are in the input's opmath type
        # and the product is rounded to float32 before the floor (checked bit for bit).
        if mode == "nearest" and size_out == size_in:
            return (j,)
        if mode == "nearest" and size_out == 2 * size_in:
            return (j // 2,)
        pos = j.to(opm) if mode == "nearest" else j.to(opm) + 0.5
        src = torch.floor((pos * _ratio(size_in, size_out, scale, opm)).float())
        return (src.long().clamp_max(last),)
    if mode != "bilinear":
        raise SpatialShardingError(f"interpolate mode {mode!r} has no index table")
    if size_out == size_in:  # compute_source_index_and_lambda: "scale_factor = 1, copy"
        return j, j, torch.ones(size_out, dtype=opm), torch.zeros(size_out, dtype=opm)
    if align_corners:
        ratio = (
            torch.tensor(size_in - 1, dtype=opm) / torch.tensor(size_out - 1, dtype=opm)
            if size_out > 1
            else torch.tensor(0.0, dtype=opm)
        )
        real = ratio * j.to(opm)
    else:
        # ATen's float32 ``ratio * (j + 0.5) - 0.5`` is compiled into one fused multiply-add
        # (one rounding; two would shift the weights, visibly on wide images):
        # the product is exact in float64, so computing there and rounding once matches.
        ratio = _ratio(size_in, size_out, scale, opm)
        real = (ratio.double() * (j.double() + 0.5) - 0.5).to(opm).clamp_min(0)
    # guard_index_and_lambda floors with floorf: a float64 index is rounded to float first.
    i0 = torch.floor(real.float()).long().clamp_max(last)
    w1 = (real - i0.to(opm)).clamp(0, 1)
    return i0, i0 + (i0 < last).long(), 1 - w1, w1


@dataclass(frozen=True)
class ResizePlan:
    """Which input columns every rank reads to produce its chunk of the resized width."""

    exchange: ExchangePlan
    out_width: int
    out_bounds: tuple[Interval, ...]
    #: per rank: first global input column of its fetched window
    starts: tuple[int, ...]


@functools.lru_cache(maxsize=1024)
def plan_resize(
    what: str,
    width: int,
    out_width: int,
    parts: int,
    mode: str,
    align_corners: bool,
    scale: float | None,
    double: bool = False,
    sharded: bool = True,
) -> ResizePlan:
    """Plan the width resize ``width -> out_width`` over ``parts`` ranks (output strips follow
    DTensor chunking; a rank may get none when ``out_width < parts``). ``sharded=False``:
    the input is replicated, every rank reads its columns locally (no neighbour check)."""
    table = resize_table(mode, width, out_width, align_corners, scale, double)
    first, last = table[0], table[1] if len(table) > 1 else table[0]
    out_bounds = tuple(all_shard_bounds(out_width, parts))
    needed, starts = [], []
    for o0, o1 in out_bounds:
        if o0 < o1:
            lo, hi = int(first[o0]), int(last[o1 - 1]) + 1
            needed.append(((lo, hi),))
            starts.append(lo)
        else:
            needed.append(())
            starts.append(0)
    plan = ExchangePlan(width, tuple(all_shard_bounds(width, parts)), tuple(needed))
    if sharded:
        plan.check_neighbours(what)
    return ResizePlan(plan, out_width, out_bounds, tuple(starts))


def _is_identity(table: tuple[Tensor, ...], size_in: int) -> bool:
    """Whether a global table maps every output index to the same input index, weight 1."""
    idx = table[0]
    if idx.numel() != size_in or not torch.equal(idx, torch.arange(size_in)):
        return False
    return len(table) == 1 or not bool(table[3].any())


@functools.lru_cache(maxsize=1024)
def _local_table(
    mode: str,
    size_in: int,
    size_out: int,
    align_corners: bool,
    scale: float | None,
    o0: int,
    o1: int,
    start: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, ...] | None:
    """Rows ``[o0, o1)`` of a resize table, indices shifted by ``start``, on ``device``;
    ``None`` when the table is the identity (nothing to do)."""
    table = resize_table(mode, size_in, size_out, align_corners, scale, dtype == torch.float64)
    if _is_identity(table, size_in):
        return None
    idx = [t[o0:o1] - start for t in table[:2]]
    weights = [t[o0:o1].to(dtype) for t in table[2:]]
    return tuple(t.to(device) for t in (*idx, *weights))


def _apply(t: Tensor, dim: int, table: tuple[Tensor, ...]) -> Tensor:
    """Resize dimension ``dim`` of ``t`` with a (local) table: gather, or a weighted sum."""
    if len(table) == 1:
        return t.index_select(dim, table[0])
    i0, i1, w0, w1 = table
    shape = [1] * t.ndim
    shape[dim] = -1
    # ATen sums t0 * w0 + t1 * w1 with the width innermost: the same order (equal to ~1 ulp;
    # the compiler may fuse ATen's multiply-add).
    return t.index_select(dim, i0) * w0.view(shape) + t.index_select(dim, i1) * w1.view(shape)
