"""``F.interpolate`` / ``nn.Upsample`` on an NCDHW volume sharded along one of D, H, W
("nearest", "nearest-exact", "trilinear" with ``align_corners`` either way; "area" is
``adaptive_avg_pool3d``, as in torch).

The 2-D code (``_interpolate.py``) does the work: a resize is an index table plus weights per
dimension computed from the *global* sizes with ATen's arithmetic (``resize_table``), and a
rank fetches the input planes its output chunk reads (``plan_resize``, one halo exchange).
Trilinear is separable: it is "bilinear"'s 1-D table applied along D, H and W in turn. Along
the sharded dim the plane exchange runs on a view with that dim moved last (as ``_volume.py``
does for convolutions); the other two dims are resized locally with their full tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._geometry import SpatialShardingError
from ._halo import gather_columns
from ._interpolate import _apply, _local_table, plan_resize
from ._pool import spatial_adaptive_avg_pool3d
from ._sharding import enter, leave, run_unsharded
from ._volume import volume_layout

MODES3D = ("nearest", "nearest-exact", "trilinear")


def _scales(size, scale_factor, recompute_scale_factor) -> tuple[float | None, ...]:
    """The per-dim scales ATen receives (``F.interpolate``'s rule): the given
    ``scale_factor`` unless an explicit size or ``recompute_scale_factor`` is used."""
    if size is not None or recompute_scale_factor or scale_factor is None:
        return (None, None, None)
    sf = scale_factor if isinstance(scale_factor, (list, tuple)) else (scale_factor,) * 3
    return tuple(float(s) for s in sf)


def spatial_interpolate3d(
    x: DTensor,
    size=None,
    scale_factor=None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
    what: str = "interpolate",
) -> DTensor:
    """``F.interpolate`` of a volume sharded along D, H or W; same values and input gradient
    as on the whole volume. The output keeps the input's placements."""
    if mode == "area" and not antialias:  # torch runs it as adaptive_avg_pool3d
        probe = torch.empty(x.shape, device="meta")
        args = (size, scale_factor, mode, align_corners, recompute_scale_factor)
        return spatial_adaptive_avg_pool3d(x, F.interpolate(probe, *args).shape[2:], what)
    if mode not in MODES3D or antialias:
        raise SpatialShardingError(
            f"{what}: interpolate mode={mode!r}{' with antialias' if antialias else ''} is not "
            f"supported on a sharded volume (supported: {', '.join(MODES3D)}, area). Use one of "
            f"those, or gather explicitly (x.full_tensor())."
        )
    args = (size, scale_factor, mode, align_corners, recompute_scale_factor)
    # torch's own argument checks and output shape, computing nothing. The shape rule is the
    # same for every mode; "nearest" skips the (slow) meta decomposition of trilinear.
    meta = (size, scale_factor, "nearest", None, recompute_scale_factor)
    probe = torch.empty(x.shape, device="meta")
    out_shape = tuple(F.interpolate(probe, *(meta if mode == "trilinear" else args)).shape)
    x, layout = volume_layout(x, what, tiles=True)
    table_mode = "bilinear" if mode == "trilinear" else mode  # the same 1-D linear table
    align = bool(align_corners) if mode == "trilinear" else False
    scales = _scales(size, scale_factor, recompute_scale_factor)
    if not layout.width_sharded:
        from ._tiles_ops import tile_interpolate_replicated, tile_mesh_axes

        if tile_mesh_axes(layout, 5):  # a pooled map resized back onto the tiles
            args = (out_shape[2:], scales, table_mode, align, what)
            return tile_interpolate_replicated(x, layout, *args)
        return run_unsharded(x, layout, lambda t: F.interpolate(t, *args))
    if layout.is_tile:  # two or three of D, H, W sharded
        from ._tiles_ops import tile_interpolate

        args = (out_shape[2:], scales, table_mode, align, what)
        return tile_interpolate(x, layout, *args)
    double = x.dtype == torch.float64
    d, rank = layout.dim, layout.sp_rank
    n_in, n_out, scale = x.shape[d], out_shape[d], scales[d - 2]
    rp = plan_resize(what, n_in, n_out, layout.sp_size, table_mode, align, scale, double)
    o0, o1 = rp.out_bounds[rank]
    # Every rank takes part in the exchange, even one with no output planes: others may
    # need its planes, and its backward must send their gradients back.
    y = gather_columns(enter(x).movedim(d, -1), rp.exchange, rank, layout.sp_group)
    y = y.movedim(-1, d)
    for dim in (4, 3, 2):  # width first, as ATen sums
        lo, hi, start = (o0, o1, rp.starts[rank]) if dim == d else (0, out_shape[dim], 0)
        key = (table_mode, x.shape[dim], out_shape[dim], align, scales[dim - 2], lo, hi, start)
        table = _local_table(*key, x.dtype, y.device)
        if table is not None:
            y = _apply(y, dim, table)
    return leave(y, layout, out_shape)
