"""``F.interpolate`` / ``nn.Upsample`` on every layout ("nearest", "nearest-exact", the
linear modes; "area" is torch's adaptive average pool): per dim an index table and weights
from the *global* sizes with ATen's arithmetic, applied with ``index_select`` after one halo
exchange per sharded dim (``plan_resize``): docs/halo.md, "Resizing".
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Shard

from ._dims import GRID_MESH_DIMS, ParallelDims, mesh_axis
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds
from ._halo import gather_columns
from ._layout import memory_format
from ._mode import register_handler, spatial_module
from ._runtime import current_runtime
from ._sharding import SpatialLayout, enter, leave, run_unsharded, spatial_layout
from ._tiles import along, layout_axes


def resize_sizes(
    in_sizes: tuple[int, ...],
    size,
    scale_factor,
    mode: str,
    align_corners: bool | None,
    recompute_scale_factor: bool | None,
    what: str = "interpolate",
) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
    """Output spatial sizes and the scales ATen receives (``F.interpolate``'s rules: a
    ``scale_factor`` gives ``floor(in * scale)`` and, unless recomputed, is passed on)."""
    n = len(in_sizes)
    if mode in ("nearest", "nearest-exact", "area") and align_corners is not None:
        raise ValueError(
            "align_corners option can only be set with the interpolating modes: "
            "linear | bilinear | bicubic | trilinear"
        )
    if (size is None) == (scale_factor is None):
        raise ValueError("exactly one of size or scale_factor should be defined")
    if size is not None and recompute_scale_factor:
        raise ValueError("recompute_scale_factor is not meaningful with an explicit size.")
    v, name = (size, "size") if size is not None else (scale_factor, "scale_factor")
    per_dim = tuple(v) if isinstance(v, (list, tuple)) else (v,) * n
    if len(per_dim) != n:
        raise ValueError(f"{what}: {name} {v} must give {n} values, one per spatial dim")
    if size is not None:
        out, scales = tuple(int(o) for o in per_dim), (None,) * n
    else:
        sf = tuple(float(f) for f in per_dim)
        out = tuple(math.floor(i * f) for i, f in zip(in_sizes, sf, strict=True))
        scales = (None,) * n if recompute_scale_factor else sf
    if min(out) < 1:
        raise SpatialShardingError(
            f"{what}: output size {out} of input {in_sizes} is empty; torch rejects it."
        )
    return out, scales


_geometry = functools.lru_cache(maxsize=1024)(resize_sizes)  # once per call geometry


def _ratio(size_in: int, size_out: int, scale: float | None, dtype: torch.dtype) -> Tensor:
    """ATen ``compute_scales_value``: ``1/scale`` when a scale was given, else in/out."""
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=dtype)
    return torch.tensor(size_in, dtype=dtype) / torch.tensor(size_out, dtype=dtype)


#: one resized dim, the tables' key: (mode, input size, output size, align_corners, scale)
ResizeDim = tuple[str, int, int, bool, float | None]


@functools.lru_cache(maxsize=256)
def resize_table(rd: ResizeDim, double: bool = False) -> tuple[Tensor, ...]:
    """Global source table of one resized dim, as ATen's CPU kernel builds it: ``(index,)``
    (nearest modes) or ``(i0, i1, w0, w1)`` (``y[j] = w0[j] * x[i0[j]] + w1[j] * x[i1[j]]``),
    indices non-decreasing; ``double``: a float64 input (float64 scales and weights)."""
    mode, size_in, size_out, align_corners, scale = rd
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
    if align_corners:  # (one output: j = 0, so any finite ratio gives 0)
        ratio = torch.tensor(size_in - 1, dtype=opm) / torch.tensor(max(size_out - 1, 1), dtype=opm)
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


@functools.lru_cache(maxsize=1024)
def plan_resize(what: str, rd: ResizeDim, parts: int, double: bool, sharded: bool):
    """The exchange of the input each rank's output chunk reads, and the chunks."""
    table = resize_table(rd, double)
    first, last = table[0], table[1] if len(table) > 1 else table[0]
    out_bounds = tuple(all_shard_bounds(rd[2], parts))
    needed = tuple(
        ((int(first[o0]), int(last[o1 - 1]) + 1),) if o0 < o1 else () for o0, o1 in out_bounds
    )
    plan = ExchangePlan(rd[1], tuple(all_shard_bounds(rd[1], parts)), needed)
    if sharded:
        plan.check_neighbours(what)
    return plan, out_bounds


@functools.lru_cache(maxsize=1024)
def _local_table(rd: ResizeDim, o0: int, o1: int, start: int, dtype, device) -> tuple | None:
    """Rows ``[o0, o1)`` of a resize table, indices from ``start``; ``None``: the identity."""
    table = resize_table(rd, dtype == torch.float64)
    if torch.equal(table[0], torch.arange(rd[1])) and (len(table) == 1 or not table[3].any()):
        return None  # the identity
    idx = [t[o0:o1] - start for t in table[:2]]
    weights = [t[o0:o1].to(dtype) for t in table[2:]]
    return tuple(t.to(device) for t in (*idx, *weights))


def _apply(t: Tensor, dim: int, table: tuple[Tensor, ...]) -> Tensor:
    """Resize dimension ``dim`` of ``t`` with a (local) table: gather, or a weighted sum."""
    if memory_format(t) is not torch.contiguous_format:
        # index_select allocates its result (and its backward the gradient) contiguous: on
        # the channels-moved-last view that is channels-last again, no layout conversion
        return _apply(t.movedim(1, -1), dim - 1, table).movedim(-1, 1)
    if len(table) == 1:
        return t.index_select(dim, table[0])
    i0, i1, w0, w1 = table
    shape = (-1, *(1,) * (t.ndim - 1 - dim))
    # ATen sums t0 * w0 + t1 * w1 with the width innermost: the same order (equal to ~1 ulp;
    # the compiler may fuse ATen's multiply-add).
    return t.index_select(dim, i0) * w0.view(shape) + t.index_select(dim, i1) * w1.view(shape)


def _replicated_axes(layout: SpatialLayout, ndim: int) -> tuple[tuple[int, int], ...]:
    """Where a replicated input's resize goes: tiles, an image's strips, or nowhere."""
    names = enumerate(layout.mesh.mesh_dim_names or ())
    grid = ((ndim - ParallelDims.dims_from_end(n), m) for m, n in names if n in GRID_MESH_DIMS)
    axes = tuple((d, m) for d, m in grid if d >= 2)
    if len(axes) > 1:
        return axes
    return ((3, layout.sp_dim),) if ndim == 4 else ()


def _resize(x: DTensor, layout: SpatialLayout, out_sizes, scales, mode, align, what):
    """The resize of ``x`` (``mode``: a table mode), last spatial dim first; None: nowhere."""
    replicated = not layout_axes(layout)
    axes = _replicated_axes(layout, x.ndim) if replicated else layout_axes(layout)
    if not axes:
        return None
    mesh, by_dim, by_mesh = layout.mesh, dict(axes), {m: d for d, m in axes}
    pls = list(enumerate(layout.placements))
    y = enter(x, tuple(Partial() if m in by_mesh else p for m, p in pls) if replicated else None)
    double = x.dtype == torch.float64
    for d in range(x.ndim - 1, 1, -1):
        rd = (mode, x.shape[d], out_sizes[d - 2], align, scales[d - 2])
        o0, o1, start = 0, rd[2], 0
        if d in by_dim:
            parts, rank, group = mesh_axis(mesh, by_dim[d])
            ex, out_bounds = plan_resize(what, rd, parts, double, not replicated)
            needed = ex.needed[rank]
            start = needed[0][0] if needed else 0
            if replicated:  # this rank's columns, read locally
                y = y.narrow(d, start, needed[0][1] - start if needed else 0)
            else:
                # (every rank takes part, also one without outputs: others read its columns)
                y = along(y, d, lambda t, e=ex, r=rank, g=group: gather_columns(t, e, r, g))
            o0, o1 = out_bounds[rank]
        table = _local_table(rd, o0, o1, start, x.dtype, y.device)
        if table is not None:
            y = _apply(y, d, table)
    pl = tuple(Shard(by_mesh[m]) if m in by_mesh else p for m, p in pls)
    return leave(y, SpatialLayout(mesh, pl, layout.sp_dim), (x.shape[0], x.shape[1], *out_sizes))


def spatial_interpolate(
    input,
    size=None,
    scale_factor=None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
    what: str = "interpolate",
):
    """``F.interpolate`` of a sharded image or volume on any layout."""
    x, ndim = input, input.ndim
    linear = {3: "linear", 4: "bilinear", 5: "trilinear"}.get(ndim)
    sized = [tuple(v) if isinstance(v, (list, tuple)) else v for v in (size, scale_factor)]
    key = (tuple(x.shape[2:]), *sized)  # hashable: the geometry is cached
    area = F.adaptive_avg_pool3d if ndim == 5 else F.adaptive_avg_pool2d  # mode "area"
    if mode == "area" and not antialias:
        recompute = True if size is None else recompute_scale_factor  # as F.interpolate
        out, _ = _geometry(*key, mode, align_corners, recompute, what)
        handler = current_runtime().registry.handler(area)  # its spatial handler, if any
        if handler is None:
            raise SpatialShardingError(
                f"{what}: interpolate mode='area' is {area.__name__}, which has no spatial "
                f"implementation registered. Use 'bilinear'/'nearest', or gather explicitly."
            )
        return handler(x, out)
    if mode not in ("nearest", "nearest-exact", linear) or antialias:
        kind = "volume" if ndim == 5 else "image"
        raise SpatialShardingError(
            f"{what}: interpolate mode={mode!r}{' with antialias' if antialias else ''} is not "
            f"supported on a sharded {kind} (supported: nearest, nearest-exact, {linear}, and "
            f"'area' via {area.__name__}). Use one of those, or gather explicitly "
            f"(x.full_tensor())."
        )
    x, layout = spatial_layout(x, what, ndim=5 if ndim == 5 else 4, tiles=True)
    out, scales = _geometry(*key, mode, align_corners, recompute_scale_factor, what)
    table_mode = "bilinear" if mode == linear else mode  # the same 1-D linear table
    y = _resize(x, layout, out, scales, table_mode, bool(align_corners), what)  # None: False
    if y is None:  # a replicated volume on a strip mesh: the plain op, output replicated
        args = (size, scale_factor, mode, align_corners, recompute_scale_factor)
        return run_unsharded(x, layout, lambda t: F.interpolate(t, *args))
    return y


_UPSAMPLE_ARGS = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor")
SpatialUpsample, SpatialUpsamplingNearest2d, SpatialUpsamplingBilinear2d = (
    spatial_module(base, spatial_interpolate, *_UPSAMPLE_ARGS, module=__name__)
    for base in (nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d)
)

# F.interpolate (called by model code or by nn.Upsample) has spatial_interpolate's arguments
register_handler(F.interpolate)(functools.partial(spatial_interpolate, what="F.interpolate"))
