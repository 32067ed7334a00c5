"""``F.pad`` on an NCDHW volume sharded along one of D, H, W: every mode (constant/zeros,
reflect, replicate, circular), negative (cropping) and zero amounts. ``nn.ZeroPad3d``,
``ConstantPad3d``, ``ReflectionPad3d``, ``ReplicationPad3d`` and ``CircularPad3d`` call it.

Padding is separable per dim (every mode pads each dim by an index map of its own), so the
sharded dim is padded first by the width re-chunk of ``_pad.py``/``_rechunk.py`` on a view
with that dim moved last (planes move to the rank that owns them in the padded volume), and
the other dims are then padded locally on every block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._dims import sharded_dims
from ._geometry import SpatialShardingError
from ._pad import width_segments
from ._rechunk import _pick, plan_remap
from ._sharding import enter, leave, spatial_layout
from ._tiles import sharded_axes
from ._volume import volume_layout


def spatial_pad3d(input: DTensor, pad, mode: str = "constant", value=None) -> DTensor:
    """``F.pad`` of a volume sharded along D, H or W, or along several of them, or of an
    image split into H x W tiles (each sharded dim re-chunked over its own mesh dim in
    turn; exact, differentiable, neighbour traffic only). Same arguments as ``F.pad``."""
    pad = [int(p) for p in pad]
    ndim = input.ndim
    # torch's own checks and output shape, computing nothing
    shape = tuple(F.pad(torch.empty(input.shape, device="meta"), pad, mode, value).shape)
    batch = 2 * (ndim - 1)  # F.pad's entries from here on pad the batch dim
    if len(pad) > batch and any(pad[batch:]) and 0 in sharded_dims(input):
        raise SpatialShardingError(
            "F.pad: padding the batch dimension of a batch-sharded tensor is not supported"
        )
    if ndim == 5:
        x, layout = volume_layout(input, "F.pad", tiles=True)
    else:
        x, layout = spatial_layout(input, "F.pad", tiles=True)
    local = enter(x)
    rest = list(pad)
    if layout.is_tile:  # two or three of D, H, W: each sharded dim in turn (separable)
        axes = sharded_axes(layout)
    elif layout.width_sharded:
        axes = [(layout.dim, layout.sp_size, layout.sp_rank, layout.sp_group)]
    else:
        axes = []
    for d, parts, rank, group in axes:
        i = 2 * (ndim - 1 - d)  # F.pad lists the last dim first
        lo, hi = (pad[i], pad[i + 1]) if len(pad) > i else (0, 0)
        if lo or hi:
            segments = tuple(width_segments(x.shape[d], lo, hi, mode))
            plan = plan_remap(x.shape[d], parts, segments)
            v = 0.0 if value is None else float(value)
            local = _pick(local.movedim(d, -1), plan, rank, group, v).movedim(-1, d)
            rest[i] = rest[i + 1] = 0
    if any(rest):
        local = F.pad(local, rest, mode, value) if mode == "constant" else F.pad(local, rest, mode)
    return leave(local, layout, shape)
