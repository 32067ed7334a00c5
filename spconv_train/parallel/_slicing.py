"""Slicing (``x[..., a:b:s]``, centre crops), ``flip`` and ``roll`` on a sharded DTensor.

Along every sharded spatial dim of any layout (the width of strips, H and W of tiles, D, H
or W of a volume, any of a block's) each is a re-chunk (``_rechunk.remap_dims``: one map
per dim, neighbour/owner point-to-point traffic, never a gather). Along the other dims the
op runs on each block as is (the batch only when it is not sharded). Index forms handled:
ints, slices (step > 0), ``...``; anything else (tensor or boolean indices, ``None``) goes
to DTensor's own rules.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ._dims import handled, norm_dim, sharded_dims, wrap
from ._mode import register_handler
from ._rechunk import Segment, cols, remap_dims
from ._sharding import SPATIAL_DIMS_BY_NDIM


def _run_local(x: DTensor, fn, removed: tuple[int, ...] = ()) -> DTensor:
    """``fn`` on every block (it must not touch the sharded dims); ``removed`` lists the
    dims ``fn`` drops (integer indices), so the sharded dims' indices shift."""
    placements = []
    for p in x.placements:
        if isinstance(p, Shard):
            d = norm_dim(p.dim, x.ndim)
            p = Shard(d - sum(1 for r in removed if r < d))
        placements.append(p)
    shape = fn(torch.empty(x.shape, device="meta")).shape
    return wrap(fn(x.to_local()), x, placements, shape)


def _expand_index(index, ndim: int):
    """``index`` as one entry per dim (ints and slices), or None if it has other forms."""
    items = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(i, (int, slice)) and i is not Ellipsis for i in items):
        return None
    if any(isinstance(i, bool) for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        fill = ndim - (len(items) - 1)
        items = (*items[:k], *(slice(None),) * fill, *items[k + 1 :])
    items = (*items, *(slice(None),) * (ndim - len(items)))
    return items if len(items) == ndim else None


def _split(x, dims) -> list[int] | None:
    """The sharded spatial dims among ``dims`` (each re-chunked), or None when ``dims``
    touch another sharded dim (the batch): then DTensor's own rules run, watched by the
    no-gather guard."""
    where = sharded_dims(x)
    remapped = [d for d in dims if d in where and d in SPATIAL_DIMS_BY_NDIM.get(x.ndim, ())]
    return None if any(d in where and d not in remapped for d in dims) else remapped


def _dims_list(dims) -> list[int]:
    return [dims] if isinstance(dims, int) else list(dims)


@register_handler(torch.Tensor.__getitem__)
def spatial_getitem(x, index):
    """``x[index]`` with basic indexing; a slice of a sharded spatial dim re-chunks it."""
    items = _expand_index(index, x.ndim) if handled(x) else None
    touched = [] if items is None else [d for d, i in enumerate(items) if i != slice(None)]
    remapped = None if items is None else _split(x, touched)
    if remapped is None or any(not isinstance(items[d], slice) for d in remapped):
        return torch.Tensor.__getitem__(x, index)
    maps = {}
    for d in remapped:
        start, stop, step = items[d].indices(x.shape[d])
        n = len(range(start, stop, step))
        maps[d] = [cols(start, n, step)] if n else []
        items = (*items[:d], slice(None), *items[d + 1 :])
    x = remap_dims(x, maps, "slicing x[..., a:b:s]") if maps else x
    if all(i == slice(None) for i in items):
        return x
    removed = tuple(d for d, i in enumerate(items) if isinstance(i, int))
    return _run_local(x, lambda t: t[items], removed)


@register_handler(torch.flip, torch.Tensor.flip)
def spatial_flip(x, *dims, **kwargs):
    """``torch.flip`` / ``x.flip``: reversing a sharded dim mirrors the owners (rank r <->
    rank n-1-r, point to point)."""
    given = kwargs["dims"] if "dims" in kwargs else dims[0] if len(dims) == 1 else dims
    wanted = [norm_dim(d, x.ndim) for d in _dims_list(given)] if handled(x) else []
    remapped = _split(x, wanted) if handled(x) else None
    if remapped is None:
        return torch.flip(x, given)
    n = x.shape
    x = remap_dims(x, {d: [cols(n[d] - 1, n[d], -1)] for d in remapped}, "torch.flip")
    rest = [d for d in wanted if d not in remapped]
    return _run_local(x, lambda t: torch.flip(t, rest)) if rest else x


@register_handler(torch.roll, torch.Tensor.roll)
def spatial_roll(x, shifts, dims=None):
    """``torch.roll`` along given dims; along a sharded one a re-chunk with wrap-around."""
    if dims is None or not handled(x):
        return torch.roll(x, shifts, dims)
    shifts_l, dims_l = _dims_list(shifts), [norm_dim(d, x.ndim) for d in _dims_list(dims)]
    remapped = _split(x, dims_l) if len(shifts_l) == len(dims_l) else None
    if remapped is None:
        return torch.roll(x, shifts, dims)
    totals: dict[int, int] = {}  # rolls along one dim add up
    local_s, local_d = [], []
    for s, d in zip(shifts_l, dims_l, strict=True):
        if d in remapped:
            totals[d] = totals.get(d, 0) + s
        else:
            local_s.append(s)
            local_d.append(d)
    maps: dict[int, list[Segment]] = {}
    for d, s in totals.items():
        n, k = x.shape[d], s % x.shape[d]
        maps[d] = [g for g in (cols(n - k, k), cols(0, n - k)) if g.length]
    x = remap_dims(x, maps, "torch.roll")
    return _run_local(x, lambda t: torch.roll(t, local_s, local_d)) if local_d else x
