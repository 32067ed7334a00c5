"""``F.interpolate`` / ``nn.Upsample`` on every layout: width strips, H x W tiles, volume
blocks ("nearest", "nearest-exact" and the linear mode of the input's rank, "bilinear" or
"trilinear", with ``align_corners`` either way; "area" is torch's adaptive average pool).

One implementation over the layout's sharded axes (``_tiles.layout_axes``). The resize is an
index table plus weights per dimension from the global sizes (``_resize_plan.py``), applied
width first, then height, then depth, in the order ATen's CPU kernel sums. Along a sharded
dim a rank fetches the input columns its output chunk reads (``plan_resize``, one halo
exchange over that dim's mesh dim, done on the result of the dims before it) and applies
the table restricted to its chunk; autograd through ``index_select`` gives the backward. A
spatially replicated input (e.g. DeepLab's pooled branch) is resized straight into this
rank's output part: each rank reads its columns locally and its input gradient is only its
part of the sum (``Partial`` on the spatial mesh dims).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Shard

from ._geometry import SpatialShardingError
from ._halo import gather_columns
from ._label import module_label
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._resize_plan import _apply as _apply  # re-exported: the resize arithmetic's names
from ._resize_plan import _local_table as _local_table
from ._resize_plan import plan_resize
from ._resize_plan import resize_sizes as resize_sizes
from ._runtime import current_runtime
from ._sharding import (
    TILE_MESH_NAMES,
    SpatialLayout,
    enter,
    leave,
    run_unsharded,
    spatial_layout,
)
from ._tiles import along, layout_axes

#: the linear mode of each tensor rank (its 1-D table is the "bilinear" one, per dim)
LINEAR = {3: "linear", 4: "bilinear", 5: "trilinear"}
#: torch's adaptive average pool of each tensor rank ("area" mode is exactly that)
_AREA = {4: F.adaptive_avg_pool2d, 5: F.adaptive_avg_pool3d}


@functools.lru_cache(maxsize=1024)
def _geometry(in_sizes, size, scale_factor, mode, align_corners, recompute, what):
    """``resize_sizes`` plus the empty-output check, once per call geometry."""
    out, scales = resize_sizes(in_sizes, size, scale_factor, mode, align_corners, recompute, what)
    if min(out) < 1:
        raise SpatialShardingError(
            f"{what}: output size {out} of input {in_sizes} is empty; torch rejects it."
        )
    return out, scales


def _hashable(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _replicated_axes(layout: SpatialLayout, ndim: int) -> tuple[tuple[int, int], ...]:
    """Where a spatially replicated input's resize output goes: the tiles of a tile mesh
    (``sp_d`` -> D, ``sp_h`` -> H, ``sp_w`` -> W), width strips of an image on a strip
    mesh, nowhere (stays replicated) for a volume on a strip mesh."""
    names = layout.mesh.mesh_dim_names or ()
    axes = tuple(
        (i + ndim - 3, names.index(n))
        for i, n in enumerate(TILE_MESH_NAMES)
        if n in names and i + ndim - 3 >= 2
    )
    if len(axes) > 1:
        return axes
    return ((3, layout.sp_dim),) if ndim == 4 else ()


def _resize(x: DTensor, layout: SpatialLayout, out_sizes, scales, mode, align, what):
    """The resize of ``x`` over its layout's sharded axes (or, replicated, into the parts of
    ``_replicated_axes``), last spatial dim first; ``mode`` is a table mode."""
    replicated = not layout_axes(layout)
    axes = _replicated_axes(layout, x.ndim) if replicated else layout_axes(layout)
    if not axes:
        return None
    mesh, by_dim = layout.mesh, dict(axes)
    grad_pl = list(layout.placements)
    for _, m in axes:
        grad_pl[m] = Partial()
    y = enter(x, tuple(grad_pl) if replicated else None)
    double = x.dtype == torch.float64
    for d in range(x.ndim - 1, 1, -1):
        n_out, scale = out_sizes[d - 2], scales[d - 2]
        o0, o1, start = 0, n_out, 0
        if d in by_dim:
            m = by_dim[d]
            parts, rank = mesh.size(m), mesh.get_local_rank(m)
            rp = plan_resize(
                what, x.shape[d], n_out, parts, mode, align, scale, double, not replicated
            )
            if replicated:
                needed = rp.exchange.needed[rank]
                lo, hi = needed[0] if needed else (0, 0)
                y = y.narrow(d, lo, hi - lo)
            else:
                # Every rank takes part in the exchange, even one with no output columns:
                # others may need its columns, and its backward sends their gradients back.
                ex, group = rp.exchange, mesh.get_group(m)
                y = along(y, d, lambda t, e=ex, r=rank, g=group: gather_columns(t, e, r, g))
            (o0, o1), start = rp.out_bounds[rank], rp.starts[rank]
        table = _local_table(
            mode, x.shape[d], n_out, align, scale, o0, o1, start, x.dtype, y.device
        )
        if table is not None:
            y = _apply(y, d, table)
    pl = list(layout.placements)
    for d, m in axes:
        pl[m] = Shard(d)
    out = SpatialLayout(mesh, tuple(pl), layout.sp_dim)
    return leave(y, out, (x.shape[0], x.shape[1], *out_sizes))


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
    """``F.interpolate`` of a sharded DTensor (an NCHW image or NCDHW volume on any
    layout); same values and input gradient as on the whole tensor. Supports "nearest",
    "nearest-exact" and the rank's linear mode (align_corners either way), ``size`` or
    ``scale_factor`` and ``recompute_scale_factor``; "area" runs through the registered
    spatial adaptive average pool (exactly what torch does)."""
    key = (tuple(x.shape[2:]), _hashable(size), _hashable(scale_factor))
    linear = LINEAR.get(x.ndim)
    if mode == "area" and not antialias:
        recompute = True if size is None else recompute_scale_factor  # as F.interpolate
        out, _ = _geometry(*key, mode, align_corners, recompute, what)
        return _area(x, out, what)
    if mode not in ("nearest", "nearest-exact", linear) or antialias:
        kind = "volume" if x.ndim == 5 else "image"
        area = _AREA.get(x.ndim, F.adaptive_avg_pool2d).__name__
        raise SpatialShardingError(
            f"{what}: interpolate mode={mode!r}{' with antialias' if antialias else ''} is not "
            f"supported on a sharded {kind} (supported: nearest, nearest-exact, {linear}, and "
            f"'area' via {area}). Use one of those, or gather explicitly (x.full_tensor())."
        )
    x, layout = spatial_layout(x, what, ndim=5 if x.ndim == 5 else 4, tiles=True)
    if mode == linear and align_corners is None:
        align_corners = False
    out, scales = _geometry(*key, mode, align_corners, recompute_scale_factor, what)
    table_mode = "bilinear" if mode == linear else mode  # the same 1-D linear table
    y = _resize(x, layout, out, scales, table_mode, bool(align_corners), what)
    if y is None:  # a replicated volume on a strip mesh: the plain op, output replicated
        args = (size, scale_factor, mode, align_corners, recompute_scale_factor)
        return run_unsharded(x, layout, lambda t: F.interpolate(t, *args))
    return y


def _area(x, out_sizes: tuple[int, ...], what: str):
    """``mode='area'`` is torch's adaptive average pool: use its spatial handler if any."""
    fn = _AREA.get(x.ndim, F.adaptive_avg_pool2d)
    handler = current_runtime().registry.handler(fn)
    if handler is None:
        raise SpatialShardingError(
            f"{what}: interpolate mode='area' is {fn.__name__}, which has no spatial "
            f"implementation registered. Use 'bilinear'/'nearest', or gather explicitly."
        )
    return handler(x, out_sizes)


class _SpatialUpsampleMixin:
    """Forward of the spatial ``nn.Upsample`` family: DTensors go to ``spatial_interpolate``."""

    spatial_name: str = ""

    def forward(self, input: Tensor) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input)
        args = (self.size, self.scale_factor, self.mode, self.align_corners)
        rc = self.recompute_scale_factor
        return spatial_interpolate(input, *args, rc, what=module_label(self))


@register_spatial_module(nn.Upsample)
class SpatialUpsample(_SpatialUpsampleMixin, nn.Upsample):
    """``nn.Upsample`` that resizes a sharded DTensor part by part with global coordinates
    (``parallelize`` swaps it in place; plain tensors run as usual)."""


@register_spatial_module(nn.UpsamplingNearest2d)
class SpatialUpsamplingNearest2d(_SpatialUpsampleMixin, nn.UpsamplingNearest2d):
    """``nn.UpsamplingNearest2d`` on a sharded DTensor (see ``SpatialUpsample``)."""


@register_spatial_module(nn.UpsamplingBilinear2d)
class SpatialUpsamplingBilinear2d(_SpatialUpsampleMixin, nn.UpsamplingBilinear2d):
    """``nn.UpsamplingBilinear2d`` on a sharded DTensor (see ``SpatialUpsample``)."""


@register_handler(F.interpolate)
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
    args = (size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    return spatial_interpolate(input, *args, what="F.interpolate")
