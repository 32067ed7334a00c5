"""``F.pad`` on a width-sharded DTensor, every mode (constant/zeros, reflect, replicate,
circular), negative (cropping) and zero amounts; ``nn.ZeroPad2d``, ``ConstantPad2d``,
``ReflectionPad2d``, ``ReplicationPad2d`` and ``CircularPad2d`` call it.

The width part is a re-chunk (``_rechunk``): the padded width is chunked afresh, so columns
move to the rank that owns them in the output; reflect/replicate read the edge ranks' own
columns (or a thin strip's neighbours), circular the wrap-around pair. The height (and, for
constant padding, channel) part is local on every strip. H x W tiles take the per-dim
path of ``_pad3d.py`` (each sharded dim re-chunked over its mesh dim in turn).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dims import handled, sharded_dims
from ._geometry import SpatialShardingError
from ._mode import register_handler
from ._rechunk import cols, fill, remap_width
from ._sharding import leave, spatial_layout


def width_segments(width: int, left: int, right: int, mode: str) -> list:
    """Re-chunk map of padding the width by ``left``/``right`` columns (negative: crop)."""
    a, b = max(0, -left), width - max(0, -right)
    if b <= a:
        raise SpatialShardingError(f"F.pad: cropping ({left}, {right}) leaves no column of {width}")
    pl, pr = max(left, 0), max(right, 0)
    mid = cols(a, b - a)
    if mode == "constant":
        sides = fill(pl), fill(pr)
    elif mode == "reflect":
        sides = cols(pl, pl, -1), cols(width - 2, pr, -1)
    elif mode == "replicate":
        sides = cols(0, pl, 0), cols(width - 1, pr, 0)
    else:  # circular wraps within the cropped part, as torch does
        sides = cols(b - pl, pl), cols(a, pr)
    return [s for s in (sides[0], mid, sides[1]) if s.length]


@register_handler(F.pad, torch._C._nn.pad)
def spatial_pad(input, pad, mode: str = "constant", value=None):
    """``F.pad`` on a width-sharded DTensor (exact, differentiable, neighbour traffic)."""
    if handled(input) and input.ndim == 5:  # NCDHW volume: _pad3d.py
        from ._pad3d import spatial_pad3d

        return spatial_pad3d(input, pad, mode, value)
    if not handled(input) or input.ndim != 4:
        return F.pad(input, pad, mode, value)
    pad = [int(p) for p in pad]
    # torch's own checks and output shape, computing nothing
    shape = F.pad(torch.empty(input.shape, device="meta"), pad, mode, value).shape
    if len(pad) > 6 and any(pad[6:]) and 0 in sharded_dims(input):
        raise SpatialShardingError(
            "F.pad: padding the batch dimension of a batch-sharded tensor is not supported"
        )
    x, layout = spatial_layout(input, "F.pad", tiles=True)
    if layout.is_tile:  # H x W tiles: each sharded dim re-chunked in turn (separable)
        from ._pad3d import spatial_pad3d

        return spatial_pad3d(input, pad, mode, value)
    v = 0.0 if value is None else float(value)
    if pad[0] or pad[1]:
        x = remap_width(x, width_segments(x.shape[3], pad[0], pad[1], mode), v, "F.pad")
    if not any(pad[2:]):
        return x
    local = x.to_local()
    rest = (0, 0, *pad[2:])
    out = F.pad(local, rest, mode, value) if mode == "constant" else F.pad(local, rest, mode)
    return leave(out, layout, tuple(shape))
