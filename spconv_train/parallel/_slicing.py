"""Slicing (``x[..., a:b:s]``, centre crops), ``flip`` and ``roll`` on a width-sharded DTensor.

Along the width each is a re-chunk (``_rechunk``): neighbour/owner point-to-point traffic,
never a gather. Along the other dimensions the op runs on each strip as is (the batch only
when it is not sharded). Index forms handled: ints, slices (step > 0), ``...``; anything
else (tensor or boolean indices, ``None``) goes to DTensor's own rules.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ._dims import handled, norm_dim, sharded_dims, wrap
from ._mode import register_handler
from ._rechunk import Segment, cols, remap_width

_WIDTH = 3


def _meta_shape(x: DTensor, fn) -> tuple[int, ...]:
    return tuple(fn(torch.empty(x.shape, device="meta")).shape)


def _run_local(x: DTensor, fn, removed: tuple[int, ...] = ()) -> DTensor:
    """``fn`` on every strip (it must not touch the sharded dims); ``removed`` lists the
    dims ``fn`` drops (integer indices), so the sharded dims' indices shift."""
    placements = []
    for p in x.placements:
        if isinstance(p, Shard):
            d = norm_dim(p.dim, x.ndim)
            p = Shard(d - sum(1 for r in removed if r < d))
        placements.append(p)
    return wrap(fn(x.to_local()), x, placements, _meta_shape(x, fn))


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


def _fallback(func, *args, **kwargs):
    # DTensor's own rules (watched by the no-gather guard)
    return func(*args, **kwargs)


@register_handler(torch.Tensor.__getitem__)
def spatial_getitem(x, index):
    """``x[index]`` with basic indexing; a slice of the width re-chunks the strips."""
    items = _expand_index(index, x.ndim) if handled(x) else None
    where = sharded_dims(x) if items is not None else {}
    if (
        items is None
        or any(d != _WIDTH and items[d] != slice(None) for d in where)
        or (_WIDTH in where and (x.ndim != 4 or not isinstance(items[_WIDTH], slice)))
    ):
        return _fallback(torch.Tensor.__getitem__, x, index)
    if _WIDTH in where and items[_WIDTH] != slice(None):
        start, stop, step = items[_WIDTH].indices(x.shape[_WIDTH])
        n = len(range(start, stop, step))
        x = remap_width(x, [cols(start, n, step)] if n else [], what="slicing x[..., a:b:s]")
        items = (*items[:_WIDTH], slice(None))
    if all(i == slice(None) for i in items):
        return x
    removed = tuple(d for d, i in enumerate(items) if isinstance(i, int))
    return _run_local(x, lambda t: t[items], removed)


def _dims_list(dims) -> list[int]:
    return [dims] if isinstance(dims, int) else list(dims)


@register_handler(torch.flip, torch.Tensor.flip)
def spatial_flip(x, *dims, **kwargs):
    """``torch.flip`` / ``x.flip``: reversing the width mirrors the owners (rank r <->
    rank n-1-r, point to point)."""
    given = kwargs["dims"] if "dims" in kwargs else dims[0] if len(dims) == 1 else dims
    if not handled(x) or x.ndim != 4:
        return _fallback(torch.flip, x, given)
    wanted = [norm_dim(d, x.ndim) for d in _dims_list(given)]
    where = sharded_dims(x)
    if any(d in where and d != _WIDTH for d in wanted):
        return _fallback(torch.flip, x, wanted)
    if _WIDTH in wanted and _WIDTH in where:
        w = x.shape[_WIDTH]
        x = remap_width(x, [cols(w - 1, w, -1)], what="torch.flip")
        wanted = [d for d in wanted if d != _WIDTH]
    return _run_local(x, lambda t: torch.flip(t, wanted)) if wanted else x


@register_handler(torch.roll, torch.Tensor.roll)
def spatial_roll(x, shifts, dims=None):
    """``torch.roll`` along given dims; along the width a re-chunk with wrap-around."""
    if dims is None or not handled(x) or x.ndim != 4:
        return _fallback(torch.roll, x, shifts, dims)
    shifts_l, dims_l = _dims_list(shifts), [norm_dim(d, 4) for d in _dims_list(dims)]
    where = sharded_dims(x)
    if len(shifts_l) != len(dims_l) or any(d in where and d != _WIDTH for d in dims_l):
        return _fallback(torch.roll, x, shifts, dims)
    local_s, local_d = [], []
    for s, d in zip(shifts_l, dims_l, strict=True):
        if d == _WIDTH and _WIDTH in where:
            w = x.shape[_WIDTH]
            k = s % w
            segs: list[Segment] = [cols(w - k, k), cols(0, w - k)]
            x = remap_width(x, [g for g in segs if g.length], what="torch.roll")
        else:
            local_s.append(s)
            local_d.append(d)
    return _run_local(x, lambda t: torch.roll(t, local_s, local_d)) if local_d else x
