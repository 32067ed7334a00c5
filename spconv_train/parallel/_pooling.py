"""Max and average pooling of any spatial rank on any layout: one implementation.

A layout is its list of sharded axes (``_tiles.layout_axes``: none, strips, tiles or
blocks). ``tile_window`` fetches the halo of every sharded dim in turn (W first, then H on
the W window, then D: corners included), with ``ceil_mode`` turned into extra padding after
(``ceil_geom``); image edges are ``-inf`` for max pooling, zeros for averaging. The unchanged
local op then runs on the window with padding 0 along the sharded dims and the layer's own
padding along the others, so a tie inside a window resolves exactly as on one device (the
window is a contiguous box of the input, scanned in the same order). ``return_indices``
gives global indices into the flattened spatial dims, as torch's.

Average pooling divides by PyTorch's divisor computed from *global* positions
(``count_include_pad``, ceil overhang) unless the local op's divisor is already right.
The divisor factors and torch's argument checks are computed once per geometry
(``functools.lru_cache``), not on every forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._sharding import enter, leave, spatial_layout
from ._tiles import ceil_geom, layout_axes, saving_tile_window, tile_shape, tile_window

#: the local ops per tensor rank: NCL signals, NCHW images, NCDHW volumes
_MAX = {3: F.max_pool1d, 4: F.max_pool2d, 5: F.max_pool3d}
_AVG = {3: F.avg_pool1d, 4: F.avg_pool2d, 5: F.avg_pool3d}


def ntuple(v, n: int) -> tuple[int, ...]:
    """``v`` (an int or an ``n``-sequence) as ``n`` ints, one per spatial dim."""
    return (int(v),) * n if isinstance(v, int) else tuple(int(a) for a in v)


@functools.lru_cache(maxsize=1024)
def _torch_checks(kind: str, shape: tuple[int, ...], *args) -> None:
    """torch's own argument checks of a pool (they differ with and without indices), on a
    meta tensor: once per geometry (a failing call is not cached and raises again)."""
    pool = _MAX if kind == "max" else _AVG
    pool[len(shape)](torch.empty(shape, device="meta"), *args)


@functools.lru_cache(maxsize=1024)
def _counts(size: int, k: int, s: int, pad: int, lo: int, hi: int, include_pad: bool):
    """PyTorch's average-pool divisor factor along one dimension for outputs ``[lo, hi)``:
    the window clipped to ``size + pad`` (``count_include_pad``) or to the input."""
    windows = [(j * s - pad, min(j * s - pad + k, size + pad)) for j in range(lo, hi)]
    return tuple(e - a if include_pad else min(e, size) - max(a, 0) for a, e in windows)


def _window(x: DTensor, what: str, k, s, p, d, ceil_mode: bool, value: float):
    """``(layout, local, tile window, op padding, geometries, sharded dims)`` of a pooling
    op on ``x``: the halo of every sharded dim fetched (``value`` at the input's edges); the
    local op pads the other dims itself."""
    x, layout = spatial_layout(x, what, len(k) + 2, tiles=True)
    shape = tuple(x.shape)
    geoms = {i: ceil_geom(shape[i], k[i - 2], s[i - 2], d[i - 2], p[i - 2], ceil_mode)
             for i in range(2, x.ndim)}  # fmt: skip
    local = enter(x)
    tw = tile_window(local, shape, layout, what, geoms, "zeros", value, pad_local=False)
    sharded = {td for td, _ in layout_axes(layout)}
    op_pad = tuple(0 if i + 2 in sharded else p[i] for i in range(x.ndim - 2))
    return layout, local, tw, op_pad, geoms, sharded


def max_pool(x: DTensor, k, s, p, d, ceil_mode: bool, return_indices: bool, what: str):
    """``F.max_pool{1,2,3}d`` of a DTensor on any layout (one tuple entry per spatial dim);
    with ``return_indices`` also the global flat indices of the maxima."""
    _torch_checks("max", tuple(x.shape), k, s, p, d, ceil_mode, return_indices)
    layout, local, tw, op_pad, _, sharded = _window(x, what, k, s, p, d, ceil_mode, float("-inf"))
    with saving_tile_window(tw, local, float("-inf")):
        out, idx = _MAX[x.ndim](tw.window, k, s, op_pad, d, ceil_mode, True)
    shape = tile_shape(tuple(x.shape), out, tw)
    if not return_indices:
        return leave(out, layout, shape)
    # window flat index -> global flat index: each window coordinate moved by the window's
    # start along the sharded dims (the op's own padding leaves the others' coordinates)
    rest, flat, stride = idx, torch.zeros_like(idx), 1
    for i in range(x.ndim - 1, 1, -1):
        n = tw.window.shape[i]
        start = tw.starts[i] if i in sharded else 0
        flat = flat + (rest % n + start) * stride
        rest, stride = rest // n, stride * x.shape[i]
    return leave(out, layout, shape), leave(flat, layout, shape)


def avg_pool(x: DTensor, k, s, p, ceil_mode, include_pad, divisor, what: str) -> DTensor:
    """``F.avg_pool{1,2,3}d`` of a DTensor on any layout: padding and ceil-mode overhang are
    counted exactly as PyTorch counts them on the whole input."""
    _torch_checks("avg", tuple(x.shape), k, s, p, ceil_mode, include_pad, divisor)
    ones = (1,) * (x.ndim - 2)
    layout, _, tw, op_pad, geoms, sharded = _window(x, what, k, s, p, ones, ceil_mode, 0.0)
    pool = _AVG[x.ndim]
    # In the window the edge padding of a sharded dim is ordinary zeros, so the local op's
    # divisor is right unless padding must not be counted or a ceil window overhangs.
    local_divisor_right = all(
        geoms[i][4] == p[i - 2] and (include_pad or p[i - 2] == 0) for i in sharded
    )
    if divisor or local_divisor_right:
        out = pool(tw.window, k, s, op_pad, ceil_mode, include_pad, divisor)
    else:
        sums = pool(tw.window, k, s, op_pad, ceil_mode, True, 1)
        div = sums.new_ones(())
        for i in range(2, x.ndim):  # the outer product of the per-dim counts
            j = i - 2
            f = _counts(x.shape[i], k[j], s[j], p[j], *tw.out_ranges[i], include_pad)
            view = [1] * (x.ndim - 2)
            view[j] = -1
            div = div * torch.tensor(f, dtype=sums.dtype, device=sums.device).view(view)
        out = sums / div
    return leave(out, layout, tile_shape(tuple(x.shape), out, tw))


def pool_args(ndim: int, kernel_size, stride, padding, dilation=1):
    """``(k, s, p, d)``: the pooling arguments as one int per spatial dim (torch's default
    stride: the kernel)."""
    k = ntuple(kernel_size, ndim)
    s = ntuple(stride, ndim) if stride else k
    return k, s, ntuple(padding, ndim), ntuple(dilation, ndim)
