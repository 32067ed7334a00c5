"""Width-sharded ``F.interpolate`` / ``nn.Upsample`` ("nearest", "nearest-exact", "bilinear").

Resizing an image strip by strip is only right if every output column takes its source
coordinate from the *global* sizes: ``F.interpolate`` on a strip would use the strip's width
and shift every coordinate. So the local op is not ``F.interpolate``: the resize is written
as an index table plus weights per dimension, computed from the global sizes with PyTorch's
own arithmetic (ATen ``UpSample.h``: ``area_pixel_compute_scale``, ``nearest_idx``,
``compute_source_index_and_lambda``, in the same float precision and with the same special
cases), and applied with ``index_select`` (nearest) or two ``index_select`` and a weighted
sum (linear), width first and then height, in the order ATen's CPU kernel sums. Rank ``r``
fetches the input columns its output chunk reads (a halo exchange) and applies the width
table restricted to its chunk; autograd through ``index_select`` gives the backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from ._geometry import ExchangePlan, Interval, SpatialShardingError, all_shard_bounds
from ._halo import gather_columns
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._runtime import current_runtime
from ._sharding import enter, leave, spatial_layout, width_sharded_placements

MODES = ("nearest", "nearest-exact", "bilinear")


def resize_sizes(
    in_hw: tuple[int, int],
    size,
    scale_factor,
    mode: str,
    align_corners: bool | None,
    recompute_scale_factor: bool | None,
    what: str = "interpolate",
) -> tuple[tuple[int, int], tuple[float | None, float | None]]:
    """Output ``(H, W)`` and the scales ATen receives, following ``F.interpolate``'s rules:
    a ``scale_factor`` (unless ``recompute_scale_factor``) gives ``floor(in * scale)`` and is
    passed on, so the coordinate map uses ``1 / scale_factor`` rather than ``in / out``."""
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
        out = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        if len(out) != 2:
            raise ValueError(f"{what}: size {size} must give 2 spatial sizes for NCHW input")
        return (int(out[0]), int(out[1])), (None, None)
    sf = tuple(scale_factor) if isinstance(scale_factor, (list, tuple)) else (scale_factor,) * 2
    if len(sf) != 2:
        raise ValueError(f"{what}: scale_factor {scale_factor} must give 2 factors for NCHW")
    out_hw = (math.floor(in_hw[0] * float(sf[0])), math.floor(in_hw[1] * float(sf[1])))
    if recompute_scale_factor:
        return out_hw, (None, None)
    return out_hw, (float(sf[0]), float(sf[1]))


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


def spatial_interpolate(
    x,
    size=None,
    scale_factor=None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
    what: str = "interpolate",
):
    """``F.interpolate`` of a width-sharded NCHW DTensor; same result as on the whole
    tensor. Supports "nearest", "nearest-exact" and "bilinear" (align_corners either way),
    ``size`` or ``scale_factor`` and ``recompute_scale_factor``; "area" runs through the
    registered spatial ``adaptive_avg_pool2d`` if there is one (exactly what torch does)."""
    if x.ndim == 5:  # NCDHW volume: _interpolate3d.py
        from ._interpolate3d import spatial_interpolate3d

        args = (size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
        return spatial_interpolate3d(x, *args, what=what)
    if mode == "area" and not antialias:
        recompute = True if size is None else recompute_scale_factor  # as F.interpolate
        out_hw, _ = resize_sizes(
            tuple(x.shape[2:]), size, scale_factor, mode, align_corners, recompute, what
        )
        return _area(x, out_hw, what)
    if mode not in MODES or antialias:
        raise SpatialShardingError(
            f"{what}: interpolate mode={mode!r}{' with antialias' if antialias else ''} is not "
            f"supported on a width-sharded image (supported: {', '.join(MODES)}, and 'area' "
            f"via adaptive_avg_pool2d). Use one of those, or gather explicitly (x.full_tensor())."
        )
    x, layout = spatial_layout(x, what, tiles=True)
    align = bool(align_corners) if mode == "bilinear" else False
    if mode == "bilinear" and align_corners is None:
        align_corners = False
    (h, w) = x.shape[2], x.shape[3]
    (out_h, out_w), (scale_h, scale_w) = resize_sizes(
        (h, w), size, scale_factor, mode, align_corners, recompute_scale_factor, what
    )
    if out_h < 1 or out_w < 1:
        raise SpatialShardingError(
            f"{what}: output size {(out_h, out_w)} of input {(h, w)} is empty; torch rejects it."
        )
    if layout.is_tile:
        from ._tiles_ops import tile_interpolate  # imports this module

        return tile_interpolate(x, layout, (out_h, out_w), (scale_h, scale_w), mode, align, what)
    if not layout.width_sharded and "sp_h" in (layout.mesh.mesh_dim_names or ()):
        from ._tiles_ops import tile_interpolate_replicated

        args = ((out_h, out_w), (scale_h, scale_w), mode, align, what)
        return tile_interpolate_replicated(x, layout, *args)
    double = x.dtype == torch.float64
    sharded = layout.width_sharded
    rp = plan_resize(what, w, out_w, layout.sp_size, mode, align, scale_w, double, sharded)
    rank = layout.sp_rank
    o0, o1 = rp.out_bounds[rank]
    if sharded:
        # Every rank takes part in the exchange, even one with no output columns: others
        # may need its columns, and its backward must send their gradients back.
        y = gather_columns(enter(x), rp.exchange, rank, layout.sp_group)
    else:
        # A width-replicated input (e.g. DeepLab's pooled branch) is resized straight into
        # this rank's output strip; each rank's input gradient is then only its part of the
        # sum, so it is labelled Partial on the sp dimension.
        grad_pl = list(layout.placements)
        grad_pl[layout.sp_dim] = Partial()
        needed = rp.exchange.needed[rank]
        lo, hi = needed[0] if needed else (0, 0)
        y = enter(x, tuple(grad_pl)).narrow(-1, lo, hi - lo)
        layout = replace(layout, placements=width_sharded_placements(layout))
    for dim, n_in, n_out, scale, lo, hi, start in (
        (3, w, out_w, scale_w, o0, o1, rp.starts[rank]),  # width first, as ATen sums
        (2, h, out_h, scale_h, 0, out_h, 0),
    ):
        key = (mode, n_in, n_out, align, scale, lo, hi, start, x.dtype, y.device)
        table = _local_table(*key)
        if table is not None:
            y = _apply(y, dim, table)
    return leave(y, layout, (x.shape[0], x.shape[1], out_h, out_w))


def _area(x, out_hw: tuple[int, int], what: str):
    """``mode='area'`` is ``adaptive_avg_pool2d`` in torch: use its spatial handler if any."""
    handler = current_runtime().registry.handler(torch.nn.functional.adaptive_avg_pool2d)
    if handler is None:
        raise SpatialShardingError(
            f"{what}: interpolate mode='area' is adaptive_avg_pool2d, which has no spatial "
            f"implementation registered. Use 'bilinear'/'nearest', or gather explicitly."
        )
    return handler(x, out_hw)


class _SpatialUpsampleMixin:
    """Forward of the spatial ``nn.Upsample`` family: DTensors go to ``spatial_interpolate``."""

    spatial_name: str = ""

    def forward(self, input: Tensor) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input)
        return spatial_interpolate(
            input,
            self.size,
            self.scale_factor,
            self.mode,
            self.align_corners,
            self.recompute_scale_factor,
            what=f"{self.spatial_name or '<module>'} ({self!r})",
        )


@register_spatial_module(nn.Upsample)
class SpatialUpsample(_SpatialUpsampleMixin, nn.Upsample):
    """``nn.Upsample`` that resizes a width-sharded ``Shard(3)`` DTensor strip by strip with
    global coordinates (``parallelize`` swaps it in place; plain tensors run as usual)."""


@register_spatial_module(nn.UpsamplingNearest2d)
class SpatialUpsamplingNearest2d(_SpatialUpsampleMixin, nn.UpsamplingNearest2d):
    """``nn.UpsamplingNearest2d`` on a width-sharded DTensor (see ``SpatialUpsample``)."""


@register_spatial_module(nn.UpsamplingBilinear2d)
class SpatialUpsamplingBilinear2d(_SpatialUpsampleMixin, nn.UpsamplingBilinear2d):
    """``nn.UpsamplingBilinear2d`` on a width-sharded DTensor (see ``SpatialUpsample``)."""


@register_handler(torch.nn.functional.interpolate)
def _functional_interpolate(
    input,
    size=None,
    scale_factor=None,
    mode="nearest",
    align_corners=None,
    recompute_scale_factor=None,
    antialias=False,
):
    """``F.interpolate`` called from model code (or by ``nn.Upsample``) on a sharded input."""
    return spatial_interpolate(
        input,
        size,
        scale_factor,
        mode,
        align_corners,
        recompute_scale_factor,
        antialias,
        what="F.interpolate",
    )
