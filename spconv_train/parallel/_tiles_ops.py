"""Window ops on tiles (``_tiles.py``): convolution, transposed convolution and
resizing of an NCHW image sharded along H and W, or of an NCDHW volume sharded along two or
three of D, H, W (the same code: every loop runs over the input's spatial dims).

Each op is its strip version composed over the sharded dims: the one-dim plan of every
sharded dim (``plan_window``, ``plan_conv_transpose``, ``plan_resize``), the exchange along W
first and then along H on the W result (corners included), and the unchanged local op. The
strip and volume ops dispatch here when their input's layout ``is_tile``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Shard

from ._conv_transpose import _place, plan_conv_transpose
from ._halo import gather_columns, sum_grad_over
from ._interpolate import _apply, _local_table, plan_resize
from ._sharding import TILE_MESH_NAMES, SpatialLayout, enter, leave
from ._tiles import along, axis_of, saving_tile_window, tile_shape, tile_window
from ._window import WindowStep, saving_steps_by_reference

#: the local op per tensor rank: NCHW images, NCDHW volumes
_CONV = {4: F.conv2d, 5: F.conv3d}
_CONV_T = {4: F.conv_transpose2d, 5: F.conv_transpose3d}


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


def tile_conv_transpose(
    x: DTensor, layout, weight, bias, stride, padding, output_padding, groups, dilation, what
) -> DTensor:
    """``F.conv_transpose2d`` / ``F.conv_transpose3d`` of a tiled DTensor: per sharded dim,
    fetch the input rows or columns that reach this rank's outputs (W, then H on the W
    window, then D), convolve with padding 0 there, place the result on the rank's output
    range, add the bias last."""
    t = local = enter(x)
    pads, out_pads, shape = list(padding), list(output_padding), list(x.shape)
    placed, steps, fetched = [], [], True
    for d in range(x.ndim - 1, 1, -1):
        ax = axis_of(layout, d)
        if ax is None:
            continue
        j, (parts, rank, group) = d - 2, ax
        k = weight.shape[d]
        tp = plan_conv_transpose(
            what, x.shape[d], parts, k, stride[j], dilation[j], padding[j], output_padding[j]
        )
        lo, hi = tp.windows[rank]
        if parts == 1 and not tp.exchange.needed[0]:
            t, fetched = t.narrow(d, 0, 0), False
        else:  # every rank takes part: others may need its rows even if it needs none
            t = along(
                t,
                d,
                lambda m, tp=tp, rank=rank, group=group: gather_columns(
                    m, tp.exchange, rank, group
                ),
            )
            steps.append(WindowStep(d, tp.exchange, rank, 0, 0, t))
        if hi <= lo:  # no input reaches this rank: one zero row keeps the graph (see strips)
            t, fetched = along(t, d, lambda m: F.pad(m, (0, 1))), False
        pads[j], out_pads[j], shape[d] = 0, 0, tp.out_width
        placed.append((d, lo * stride[j] - padding[j], *tp.out_bounds[rank]))
    w = sum_grad_over(weight, layout.grad_groups)
    conv = _CONV_T[x.ndim]
    # Save the tile by reference + the thin halo slabs, not the window copy (as tile_conv).
    saving = contextlib.nullcontext()
    if fetched and steps and torch.is_grad_enabled():
        saving = saving_steps_by_reference(t, local, tuple(steps))
    with saving:
        y = conv(t, w, None, stride, tuple(pads), tuple(out_pads), groups, dilation)
    for d, start, o0, o1 in placed:
        y = along(y, d, lambda m, start=start, o0=o0, o1=o1: _place(m, start, o0, o1))
    if bias is not None:
        b = sum_grad_over(bias, layout.grad_groups)
        y = y + b.view(1, -1, *([1] * (x.ndim - 2)))
    shape[1] = y.shape[1]
    for d in range(2, x.ndim):
        if axis_of(layout, d) is None:
            shape[d] = y.shape[d]
    return leave(y, layout, tuple(shape))


def tile_interpolate(x: DTensor, layout, out_sizes, scales, mode: str, align: bool, what: str):
    """``F.interpolate`` of a tiled DTensor (``mode`` "nearest", "nearest-exact" or
    "bilinear", the 1-D linear table that "trilinear" applies per dim too): the width is
    resized first (its input columns fetched over ``sp_w``), then the height of that result
    (its input rows fetched over ``sp_h``), then the depth, in the order ATen sums.
    ``out_sizes`` and ``scales`` have one entry per spatial dim."""
    y = enter(x)
    double = x.dtype == torch.float64
    for d in range(x.ndim - 1, 1, -1):
        n_out, scale = out_sizes[d - 2], scales[d - 2]
        ax = axis_of(layout, d)
        lo, hi, start = 0, n_out, 0
        if ax is not None:
            parts, rank, group = ax
            rp = plan_resize(what, x.shape[d], n_out, parts, mode, align, scale, double)
            y = along(
                y,
                d,
                lambda m, rp=rp, rank=rank, group=group: gather_columns(
                    m, rp.exchange, rank, group
                ),
            )
            (lo, hi), start = rp.out_bounds[rank], rp.starts[rank]
        table = _local_table(
            mode, x.shape[d], n_out, align, scale, lo, hi, start, x.dtype, y.device
        )
        if table is not None:
            y = _apply(y, d, table)
    return leave(y, layout, (x.shape[0], x.shape[1], *out_sizes))


def tile_mesh_axes(layout: SpatialLayout, ndim: int) -> tuple[tuple[int, int], ...] | None:
    """``(tensor dim, mesh dim)`` of every spatial dim a tile mesh splits, read off its
    names (``sp_d`` -> D, ``sp_h`` -> H, ``sp_w`` -> W of an ``ndim``-D tensor), or ``None``
    for a strip mesh (fewer than two of those names)."""
    names = layout.mesh.mesh_dim_names or ()
    axes = tuple(
        (i + ndim - 3, names.index(n))
        for i, n in enumerate(TILE_MESH_NAMES)
        if n in names and i + ndim - 3 >= 2
    )
    return axes if len(axes) > 1 else None


def tile_interpolate_replicated(x, layout, out_sizes, scales, mode: str, align: bool, what: str):
    """``F.interpolate`` of a spatially replicated input (e.g. DeepLabV3's pooled branch) on
    a tile mesh, straight into this rank's output tile (image or volume). Each rank's input
    gradient is only its tile's part of the sum: labelled ``Partial`` on the spatial mesh
    dims."""
    axes = tile_mesh_axes(layout, x.ndim)
    mesh, by_dim = layout.mesh, dict(axes)
    grad_pl = list(layout.placements)
    for _, m in axes:
        grad_pl[m] = Partial()
    y = enter(x, tuple(grad_pl))
    double = x.dtype == torch.float64
    for d in range(x.ndim - 1, 1, -1):
        n_out, scale = out_sizes[d - 2], scales[d - 2]
        o0, o1, start = 0, n_out, 0
        if d in by_dim:
            parts, rank = mesh.size(by_dim[d]), mesh.get_local_rank(by_dim[d])
            rp = plan_resize(what, x.shape[d], n_out, parts, mode, align, scale, double, False)
            needed = rp.exchange.needed[rank]
            lo, hi = needed[0] if needed else (0, 0)
            y = y.narrow(d, lo, hi - lo)
            (o0, o1), start = rp.out_bounds[rank], rp.starts[rank]
        key = (mode, x.shape[d], n_out, align, scale, o0, o1, start, x.dtype, y.device)
        table = _local_table(*key)
        if table is not None:
            y = _apply(y, d, table)
    pl = list(layout.placements)
    for d, m in axes:
        pl[m] = Shard(d)
    tiled = SpatialLayout(mesh, tuple(pl), axes[-1][1], dims=(axes[-1][0],), axes=axes)
    return leave(y, tiled, (x.shape[0], x.shape[1], *out_sizes))
