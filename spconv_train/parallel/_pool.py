"""Max and average pooling on every layout (the local op on ``tile_window``'s window: ties
as on one device, global indices, torch's divisor from *global* positions), and the public
functions, modules and torch-function routes of every pooling (adaptive: ``_adaptive.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ._adaptive import adaptive_pool, no_volume_indices
from ._geometry import ntuple
from ._mode import register_handler
from ._parallelize import spatial_module
from ._sharding import enter, leave, spatial_layout
from ._tiles import ceil_geom, layout_axes, tile_shape, tile_window

#: the local ops per tensor rank: NCL signals, NCHW images, NCDHW volumes
_MAX = {3: F.max_pool1d, 4: F.max_pool2d, 5: F.max_pool3d}
_AVG = {3: F.avg_pool1d, 4: F.avg_pool2d, 5: F.avg_pool3d}


@functools.lru_cache(maxsize=1024)
def _torch_checks(kind: str, shape: tuple[int, ...], *args) -> None:
    """torch's own argument checks of a pool, on a meta tensor, once per geometry."""
    pool = _MAX if kind == "max" else _AVG
    pool[len(shape)](torch.empty(shape, device="meta"), *args)


@functools.lru_cache(maxsize=1024)
def _counts(size: int, k: int, s: int, pad: int, lo: int, hi: int, include_pad: bool):
    """torch's average-pool divisor factor along one dim for outputs ``[lo, hi)``."""
    windows = [(j * s - pad, min(j * s - pad + k, size + pad)) for j in range(lo, hi)]
    return tuple(e - a if include_pad else min(e, size) - max(a, 0) for a, e in windows)


def _window(kind: str, x: DTensor, rank: int, what: str, kernel_size, stride, padding, dilation,
            ceil_mode: bool, *rest) -> tuple:  # fmt: skip
    """``(layout, window, (k, s, p, d), op padding, geometries, sharded dims)`` of a pooling op
    (the default stride: the kernel), after torch's own checks (``rest``: its other arguments)."""
    k, s, p, d = [ntuple(v, rank) for v in (kernel_size, stride or kernel_size, padding, dilation)]
    _torch_checks(kind, tuple(x.shape), k, s, p, *((d,) if kind == "max" else ()), ceil_mode, *rest)
    x, layout = spatial_layout(x, what, rank + 2, tiles=True)
    shape = tuple(x.shape)
    geoms = {i: ceil_geom(shape[i], k[i - 2], s[i - 2], d[i - 2], p[i - 2], ceil_mode)
             for i in range(2, x.ndim)}  # fmt: skip
    value = float("-inf") if kind == "max" else 0.0
    tw = tile_window(enter(x), shape, layout, what, geoms, "zeros", value, pad_local=False)
    sharded = {td for td, _ in layout_axes(layout)}
    op_pad = tuple(0 if i + 2 in sharded else p[i] for i in range(x.ndim - 2))
    return layout, tw, (k, s, p, d), op_pad, geoms, sharded


def max_pool(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
    *,
    rank: int,
    what: str = "",
):
    """``F.max_pool{rank}d`` of a DTensor on any layout (indices global, as torch's)."""
    what = what or f"max_pool{rank}d"
    no_volume_indices(rank, return_indices, what)
    geometry = (kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    layout, tw, (k, s, _, d), op_pad, _, sharded = _window("max", x, rank, what, *geometry)
    with tw.saving():
        out, idx = _MAX[x.ndim](tw.window, k, s, op_pad, d, ceil_mode, True)
    shape = tile_shape(tuple(x.shape), out, tw)
    if not return_indices:
        return leave(out, layout, shape)
    # window flat index -> global flat index: each window coordinate moved by the window's
    # start along the sharded dims (the op's own padding leaves the others' coordinates)
    rest, flat, stride = idx, torch.zeros_like(idx), 1
    for i in range(x.ndim - 1, 1, -1):
        n, start = tw.window.shape[i], tw.starts[i] if i in sharded else 0
        flat = flat + (rest % n + start) * stride
        rest, stride = rest // n, stride * x.shape[i]
    return leave(out, layout, shape), leave(flat, layout, shape)


def avg_pool(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    rank: int,
    what: str = "",
) -> DTensor:
    """``F.avg_pool{rank}d`` of a DTensor on any layout."""
    what = what or f"avg_pool{rank}d"
    include_pad, divisor = count_include_pad, divisor_override
    geometry = (kernel_size, stride, padding, 1, ceil_mode, include_pad, divisor)
    layout, tw, (k, s, p, _), op_pad, geoms, sharded = _window("avg", x, rank, what, *geometry)
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
            f = _counts(x.shape[i], k[i - 2], s[i - 2], p[i - 2], *tw.out_ranges[i], include_pad)
            f = torch.tensor(f, dtype=sums.dtype, device=sums.device)
            div = div * f.view(-1, *(1,) * (x.ndim - 1 - i))
        out = sums / div
    return leave(out, layout, tile_shape(tuple(x.shape), out, tw))


_NAMESPACES = {"F": F, "torch": torch, "torch._C._nn": torch._C._nn}


def _register(fn, names: str, pair_after: int = 0) -> None:
    """Route the torch functions ``names`` ("F.max_pool2d torch.max_pool2d") to ``fn``.
    ``pair_after`` marks functions that always return ``(values, indices)``: only their
    first ``pair_after`` positionals are geometry (the ``*_with_indices`` forms carry a
    ``return_indices`` after them that they ignore)."""
    functions = [getattr(_NAMESPACES[m], a) for m, a in (n.rsplit(".", 1) for n in names.split())]
    what = names.split()[0].removesuffix("_with_indices")

    def handler(*args, **kwargs):
        if pair_after:
            args = args[:pair_after]
            kwargs = {k: v for k, v in kwargs.items() if k != "return_indices"}
            kwargs["return_indices"] = True
        return fn(*args, what=what, **kwargs)

    register_handler(*functions)(handler)


_MAX_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_ARGS = (*_MAX_ARGS[:3], "ceil_mode", "count_include_pad", "divisor_override")
# The ``Spatial<Pool>{2,3}d`` modules (module attributes: pickled by name) and the routes.
# SpatialMode sees F.max_pool*d / F.adaptive_max_pool*d (tensor or pair) or a function always
# returning a pair (F.*_with_indices, torch._C._nn.adaptive_max_pool*d; 3-D: to refuse them
# clearly). F.avg_pool*d is torch._C._nn.avg_pool*d; torch.max_pool*d are separate objects.
for n in (2, 3):
    _max, _avg = (functools.partial(f, rank=n) for f in (max_pool, avg_pool))
    _amax, _aavg = (functools.partial(adaptive_pool, rank=n, kind=k) for k in ("max", "avg"))
    for _base, _fn, _args in (
        ("MaxPool", _max, _MAX_ARGS),
        ("AvgPool", _avg, _AVG_ARGS),
        ("AdaptiveMaxPool", _amax, ("output_size", "return_indices")),
        ("AdaptiveAvgPool", _aavg, ("output_size",)),
    ):
        _cls = spatial_module(getattr(nn, f"{_base}{n}d"), _fn, *_args, module=__name__)
        globals()[_cls.__name__] = _cls
    _register(_max, f"F.max_pool{n}d torch.max_pool{n}d")
    _register(_max, f"F.max_pool{n}d_with_indices torch._C._nn.max_pool{n}d_with_indices", 6)
    _register(_avg, f"F.avg_pool{n}d")
    _register(_aavg, f"F.adaptive_avg_pool{n}d torch._C._nn.adaptive_avg_pool{n}d")
    _register(_amax, f"F.adaptive_max_pool{n}d")
    _register(_amax, f"F.adaptive_max_pool{n}d_with_indices torch._C._nn.adaptive_max_pool{n}d", 2)
