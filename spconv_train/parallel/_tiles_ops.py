"""Convolution on tiles (``_tiles.py``): ``F.conv2d`` / ``F.conv3d`` of an NCHW image sharded
along H and W, or of an NCDHW volume sharded along two or three of D, H, W (the same code:
every loop runs over the input's spatial dims). Pools, pad, transposed convolution and
resizing are written once for every layout in their own modules (``_pooling``,
``_adaptive``, ``_pad``, ``_conv_transpose``, ``_interpolate``).

Each op is its strip version composed over the sharded dims: the one-dim plan of every
sharded dim (``plan_window``), the exchange along W
first and then along H on the W result (corners included), and the unchanged local op. The
strip and volume ops dispatch here when their input's layout ``is_tile``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._halo import sum_grad_over
from ._sharding import SpatialLayout, enter, leave
from ._tiles import axis_of, saving_tile_window, tile_shape, tile_window

#: the local op per tensor rank: NCHW images, NCDHW volumes
_CONV = {4: F.conv2d, 5: F.conv3d}


def _geoms(x: DTensor, fn) -> dict:
    """``{tensor dim: fn(dim, j)}`` over the spatial dims of ``x`` (``j`` counts from 0)."""
    return {i: fn(i, i - 2) for i in range(2, x.ndim)}


def tile_conv(
    x: DTensor,
    layout: SpatialLayout,
    weight: Tensor,
    bias: Tensor | None,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
    padding_mode: str,
    what: str,
) -> DTensor:
    """``F.conv2d`` / ``F.conv3d`` of a tiled DTensor. ``padding`` is ``(lo, hi)`` per
    spatial dim, flattened: ``(top, bottom, left, right)`` for an image, ``(front, back,
    top, bottom, left, right)`` for a volume."""
    k = weight.shape

    def geom(i, j):
        return k[i], stride[j], dilation[j], padding[2 * j], padding[2 * j + 1]

    # Symmetric zero padding of the dims no mesh dim shards is cheapest inside the conv
    # itself; the window is then just the exchanges' result and is saved by reference.
    unsplit = [j for j in range(x.ndim - 2) if axis_of(layout, j + 2) is None]
    inside = padding_mode == "zeros" and all(padding[2 * j] == padding[2 * j + 1] for j in unsplit)
    conv_pad = tuple(padding[2 * j] if inside and j in unsplit else 0 for j in range(x.ndim - 2))
    local = enter(x)
    geoms = _geoms(x, geom)
    tw = tile_window(local, tuple(x.shape), layout, what, geoms, padding_mode, pad_local=not inside)
    w, b = sum_grad_over(weight, layout.grad_groups), sum_grad_over(bias, layout.grad_groups)
    with saving_tile_window(tw, local):
        out = _CONV[x.ndim](tw.window, w, b, stride, conv_pad, dilation, groups)
    return leave(out, layout, tile_shape(tuple(x.shape), out, tw))
