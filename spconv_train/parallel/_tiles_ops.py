"""Window ops on tiles (``_tiles.py``): convolution and pooling of an NCHW image sharded
along H and W, or of an NCDHW volume sharded along two or three of D, H, W (the same code:
every loop runs over the input's spatial dims).

Each op is its strip version composed over the sharded dims: the one-dim plan of every
sharded dim (``plan_window``), the exchange along W
first and then along H on the W result (corners included), and the unchanged local op. The
strip and volume ops dispatch here when their input's layout ``is_tile``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from ._geometry import SpatialShardingError, all_shard_bounds
from ._halo import sum_grad_over
from ._pool import _counts, _segment_max, _segment_sums, _SumReplicated, adaptive_bounds
from ._sharding import SpatialLayout, enter, leave
from ._tiles import along, axis_of, ceil_geom, saving_tile_window, tile_shape, tile_window

#: the local op per tensor rank: NCHW images, NCDHW volumes
_CONV = {4: F.conv2d, 5: F.conv3d}
_MAX = {4: F.max_pool2d, 5: F.max_pool3d}
_AVG = {4: F.avg_pool2d, 5: F.avg_pool3d}


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


def tile_max_pool(x: DTensor, layout, k, s, p, d, ceil_mode: bool, return_indices: bool, what):
    """``F.max_pool2d`` / ``F.max_pool3d`` of a tiled DTensor; indices (images only) are
    global into the flattened ``H*W``."""
    geoms = _geoms(x, lambda i, j: ceil_geom(x.shape[i], k[j], s[j], d[j], p[j], ceil_mode))
    local = enter(x)
    tw = tile_window(local, tuple(x.shape), layout, what, geoms, "zeros", float("-inf"))
    with saving_tile_window(tw, local, float("-inf")):
        out, idx = _MAX[x.ndim](tw.window, k, s, 0, d, False, True)
    shape = tile_shape(tuple(x.shape), out, tw)
    if not return_indices:
        return leave(out, layout, shape)
    if x.ndim != 4:  # the 3-D callers refuse return_indices before this
        raise SpatialShardingError(f"{what}: return_indices is not supported on volumes")
    ww = tw.window.shape[-1]
    idx = (idx // ww + tw.starts[2]) * x.shape[3] + idx % ww + tw.starts[3]
    return leave(out, layout, shape), leave(idx, layout, shape)


def tile_avg_pool(x: DTensor, layout, k, s, p, ceil_mode, include_pad, divisor, what: str):
    """``F.avg_pool2d`` / ``F.avg_pool3d`` of a tiled DTensor: window sums over a
    zero-padded window, divided by PyTorch's divisor computed from global positions
    (``_pool._counts``, one factor per spatial dim)."""
    geoms = _geoms(x, lambda i, j: ceil_geom(x.shape[i], k[j], s[j], 1, p[j], ceil_mode))
    tw = tile_window(enter(x), tuple(x.shape), layout, what, geoms, "zeros", 0.0)
    pool = _AVG[x.ndim]
    if divisor:
        out = pool(tw.window, k, s, 0, False, True, divisor)
    else:
        sums = pool(tw.window, k, s, 0, False, True, 1)
        div = sums.new_ones(())
        for i in range(2, x.ndim):  # the outer product of the per-dim counts
            j = i - 2
            f = _counts(x.shape[i], k[j], s[j], p[j], *tw.out_ranges[i], include_pad)
            view = [1] * (x.ndim - 2)
            view[j] = -1
            div = div * torch.tensor(f, dtype=sums.dtype, device=sums.device).view(view)
        out = sums / div
    return leave(out, layout, tile_shape(tuple(x.shape), out, tw))


def _check_small_output(x: DTensor, layout: SpatialLayout, out_sizes, kind: str, what: str):
    """Refuse an adaptive pool whose output exceeds a quarter of the smallest tile: its
    all-reduce and replicated output would cost an activation. (So no tile is empty.)"""
    smallest, cells = 1, 1
    for d in range(2, x.ndim):
        ax = axis_of(layout, d)
        bounds = all_shard_bounds(x.shape[d], ax[0] if ax else 1)
        smallest *= min(b - a for a, b in bounds)
        cells *= out_sizes[d - 2]
    if 4 * cells > smallest:
        size = "x".join(str(o) for o in out_sizes)
        raise SpatialShardingError(
            f"{what}: pooling to {size} on tiles would all-reduce and replicate an output "
            f"larger than a quarter of a tile; tiles support global and small adaptive "
            f"{kind} pooling only. Shard one spatial dim for this layer's model, or use a "
            f"smaller output."
        )


def _tile_windows(x: DTensor, layout: SpatialLayout, d: int, out: int):
    """``(a, b, win, segs)`` of spatial dim ``d``: this rank's input range ``[a, b)``, the
    global adaptive windows (PyTorch's rule) and each window clipped to the tile, in local
    indices (empty where the window misses the tile)."""
    ax = axis_of(layout, d)
    parts, rank = (ax[0], ax[1]) if ax else (1, 0)
    a, b = all_shard_bounds(x.shape[d], parts)[rank]
    win = adaptive_bounds(x.shape[d], out)
    segs = tuple((min(max(s, a), b) - a, max(min(e, b), a) - a) for s, e in win)
    return a, b, win, segs


def _replicated(layout: SpatialLayout) -> SpatialLayout:
    """``layout`` with every spatial mesh dim ``Replicate`` (a dp ``Shard(0)`` kept)."""
    pl = list(layout.placements)
    for _, m in layout.axes:
        pl[m] = Replicate()
    return SpatialLayout(layout.mesh, tuple(pl), layout.sp_dim)


def tile_adaptive_pool(x: DTensor, layout: SpatialLayout, out_sizes, kind, indices, what):
    """Adaptive ``kind`` ("avg" / "max") pooling of a tiled DTensor; with ``indices`` (max
    only, as torch) also the global flat indices of the maxima."""
    if kind == "avg":
        return tile_adaptive_avg_pool(x, layout, tuple(out_sizes), what)
    return tile_adaptive_max_pool(x, layout, tuple(out_sizes), what, indices)


def tile_adaptive_avg_pool(
    x: DTensor, layout: SpatialLayout, out_sizes: tuple[int, ...], what: str
) -> DTensor:
    """``F.adaptive_avg_pool2d`` / ``F.adaptive_avg_pool3d`` of a tiled DTensor (one output
    size per spatial dim): each rank sums its own elements of every output cell's window
    (global PyTorch windows), divides by the global window sizes, and an all-reduce over the
    spatial mesh dims adds the parts. The output is ``Replicate`` on them (meant for global /
    small pooling, as in DeepLabV3, LR-ASPP and squeeze-excitation: the all-reduce is
    output-sized). Refused when the output exceeds a quarter of the smallest tile: that
    all-reduce and the replicated output would cost an activation."""
    _check_small_output(x, layout, out_sizes, "average", what)
    t = enter(x)
    div = torch.ones((), dtype=t.dtype, device=t.device)
    for d in range(x.ndim - 1, 1, -1):
        _, _, win, segs = _tile_windows(x, layout, d, out_sizes[d - 2])
        t = along(t, d, lambda m, segs=segs: _segment_sums(m, segs))
        view = [1] * (x.ndim - 2)
        view[d - 2] = -1
        lens = torch.tensor([e - s for s, e in win], dtype=t.dtype, device=t.device)
        div = div * lens.view(view)
    t = t / div
    for _, m in layout.axes:
        if layout.mesh.size(m) > 1:
            t = _SumReplicated.apply(t, layout.mesh.get_group(m))
    return leave(t, _replicated(layout), (x.shape[0], x.shape[1], *out_sizes))


def tile_adaptive_max_pool(
    x: DTensor,
    layout: SpatialLayout,
    out_sizes: tuple[int, ...],
    what: str,
    return_indices: bool = False,
):
    """``F.adaptive_max_pool2d`` / ``F.adaptive_max_pool3d`` values of a tiled DTensor, for
    small outputs as the average (``Replicate`` on the spatial mesh dims). Each rank takes
    the maximum of its own part of every output window and the global flat index of the
    first element (row-major) that reaches it, reducing W first, then H, then D; an
    all-reduce MAX over the spatial mesh dims gives the value, an all-reduce MIN of the
    indices of the ranks holding it picks the first maximum in row-major order, as one
    device does, and only that rank passes the gradient. So values, gradients and ties
    equal one device's (NaN inputs are not: torch propagates them). ``return_indices``: the
    winning global flat index too (into the flattened spatial dims, as torch's), replicated
    like the values."""
    _check_small_output(x, layout, out_sizes, "max", what)
    t, idx, stride = enter(x), None, 1
    valid = torch.ones((), dtype=torch.bool, device=t.device)
    for d in range(x.ndim - 1, 1, -1):
        a, _, _, segs = _tile_windows(x, layout, d, out_sizes[d - 2])
        m = t.movedim(d, -1)
        v, arg = _segment_max(m, segs)  # arg: the column of the max (m.shape[-1] if empty)
        at = arg.clamp(max=m.shape[-1] - 1)
        inner = 0 if idx is None else idx.movedim(d, -1).gather(-1, at)
        t, idx = v.movedim(-1, d), (inner + (at + a) * stride).movedim(-1, d)
        stride *= x.shape[d]
        view = [1] * (x.ndim - 2)
        view[d - 2] = -1
        hit = torch.tensor([e > s for s, e in segs], device=t.device)
        valid = valid & hit.view(view)
    best = t.detach().clone()
    groups = [layout.mesh.get_group(m) for _, m in layout.axes if layout.mesh.size(m) > 1]
    for group in groups:  # max over the tile mesh: over sp_w, then over sp_h (and sp_d)
        dist.all_reduce(best, dist.ReduceOp.MAX, group=group)
    cand = torch.where(valid & (t.detach() == best), idx, torch.iinfo(torch.int64).max)
    for group in groups:
        dist.all_reduce(cand, dist.ReduceOp.MIN, group=group)
    out = torch.where(valid & (idx == cand), t, best)  # only the owner passes the gradient
    shape = (x.shape[0], x.shape[1], *out_sizes)
    values = leave(out, _replicated(layout), shape)
    return (values, leave(cand, _replicated(layout), shape)) if return_indices else values
