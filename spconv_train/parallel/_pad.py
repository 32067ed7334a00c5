"""``F.pad`` of a sharded NCHW image or NCDHW volume, on any layout (strips, tiles,
blocks): every mode (constant/zeros, reflect, replicate, circular), negative (cropping)
and zero amounts. ``nn.ZeroPad2d`` / ``ZeroPad3d``, ``ConstantPad*``, ``ReflectionPad*``,
``ReplicationPad*`` and ``CircularPad*`` call it.

Padding is separable per dim (every mode pads each dim by an index map of its own), so each
sharded dim is re-chunked in turn over its own mesh dim (``_rechunk``: the padded size is
chunked afresh, elements move to the rank that owns them in the output; reflect/replicate
read the edge ranks' own elements, circular the wrap-around pair), on a view with that dim
moved last; the other dims are then padded locally on every block.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._dims import handled, sharded_dims
from ._geometry import SpatialShardingError
from ._mode import register_handler
from ._rechunk import cols, fill, remap_axis
from ._sharding import enter, leave, spatial_layout
from ._tiles import sharded_axes


def width_segments(width: int, left: int, right: int, mode: str) -> list:
    """Re-chunk map of padding a dim of ``width`` by ``left``/``right`` (negative: crop)."""
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


@functools.lru_cache(maxsize=1024)
def _out_shape(shape: tuple[int, ...], pad: tuple[int, ...], mode: str, value) -> tuple:
    """torch's own checks and output shape of the pad, on a meta tensor, once per geometry."""
    return tuple(F.pad(torch.empty(shape, device="meta"), pad, mode, value).shape)


@register_handler(F.pad, torch._C._nn.pad)
def spatial_pad(input, pad, mode: str = "constant", value=None):
    """``F.pad`` of a sharded image or volume (exact, differentiable, neighbour traffic
    only). Same arguments as ``F.pad``."""
    if not handled(input) or input.ndim not in (4, 5):
        return F.pad(input, pad, mode, value)
    pad = [int(p) for p in pad]
    ndim = input.ndim
    shape = _out_shape(tuple(input.shape), tuple(pad), mode, value)
    batch = 2 * (ndim - 1)  # F.pad's entries from here on pad the batch dim
    if len(pad) > batch and any(pad[batch:]) and 0 in sharded_dims(input):
        raise SpatialShardingError(
            "F.pad: padding the batch dimension of a batch-sharded tensor is not supported"
        )
    x, layout = spatial_layout(input, "F.pad", ndim, tiles=True)
    local, rest = enter(x), list(pad)
    v = 0.0 if value is None else float(value)
    for d, parts, rank, group in sharded_axes(layout):
        i = 2 * (ndim - 1 - d)  # F.pad lists the last dim first
        lo, hi = (pad[i], pad[i + 1]) if len(pad) > i else (0, 0)
        if lo or hi:
            segments = width_segments(x.shape[d], lo, hi, mode)
            local = remap_axis(local, d, x.shape[d], segments, (parts, rank, group), v)
            rest[i] = rest[i + 1] = 0
    if any(rest):
        local = F.pad(local, rest, mode, value) if mode == "constant" else F.pad(local, rest, mode)
    return leave(local, layout, shape)
