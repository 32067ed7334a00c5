"""Slicing (``x[..., a:b:s]``, centre crops), ``flip`` and ``roll`` on a sharded DTensor.

Along the width of strips (and along H or W of H x W tiles) each is a re-chunk
(``_rechunk``): neighbour/owner point-to-point traffic, never a gather. Along the other
dimensions the op runs on each strip as is (the batch only when it is not sharded). Index
forms handled: ints, slices (step > 0), ``...``; anything else (tensor or boolean indices,
``None``) goes to DTensor's own rules.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ._dims import handled, norm_dim, sharded_dims, wrap
from ._mode import register_handler
from ._rechunk import Segment, cols, remap_dim


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


def _remapped(x: DTensor, dims) -> list[int]:
    """The sharded dims among ``dims`` that a re-chunk handles: W of strips, H and W of
    H x W tiles (NCHW images only)."""
    where = sharded_dims(x)
    return [d for d in dims if d in where and d >= 2 and x.ndim == 4]


def _unhandled(x: DTensor, dims) -> bool:
    """Whether the op touches a sharded dim that no re-chunk handles (the batch, a
    volume's): then DTensor's own rules run, watched by the no-gather guard."""
    where, remapped = sharded_dims(x), _remapped(x, dims)
    return any(d in where and d not in remapped for d in dims)


@register_handler(torch.Tensor.__getitem__)
def spatial_getitem(x, index):
    """``x[index]`` with basic indexing; a slice of a sharded spatial dim (the width of
    strips, H or W of tiles) re-chunks it."""
    items = _expand_index(index, x.ndim) if handled(x) else None
    touched = [] if items is None else [d for d, i in enumerate(items) if i != slice(None)]
    if (
        items is None
        or _unhandled(x, touched)
        or any(not isinstance(items[d], slice) for d in _remapped(x, touched))
    ):
        return _fallback(torch.Tensor.__getitem__, x, index)
    for d in _remapped(x, touched):
        start, stop, step = items[d].indices(x.shape[d])
        n = len(range(start, stop, step))
        x = remap_dim(x, d, [cols(start, n, step)] if n else [], what="slicing x[..., a:b:s]")
        items = (*items[:d], slice(None), *items[d + 1 :])
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
    if _unhandled(x, wanted):
        return _fallback(torch.flip, x, wanted)
    for d in _remapped(x, wanted):
        n = x.shape[d]
        x = remap_dim(x, d, [cols(n - 1, n, -1)], what="torch.flip")
        wanted = [k for k in wanted if k != d]
    return _run_local(x, lambda t: torch.flip(t, wanted)) if wanted else x


@register_handler(torch.roll, torch.Tensor.roll)
def spatial_roll(x, shifts, dims=None):
    """``torch.roll`` along given dims; along the width a re-chunk with wrap-around."""
    if dims is None or not handled(x) or x.ndim != 4:
        return _fallback(torch.roll, x, shifts, dims)
    shifts_l, dims_l = _dims_list(shifts), [norm_dim(d, 4) for d in _dims_list(dims)]
    if len(shifts_l) != len(dims_l) or _unhandled(x, dims_l):
        return _fallback(torch.roll, x, shifts, dims)
    remapped = _remapped(x, dims_l)
    local_s, local_d = [], []
    for s, d in zip(shifts_l, dims_l, strict=True):
        if d in remapped:
            w = x.shape[d]
            k = s % w
            segs: list[Segment] = [cols(w - k, k), cols(0, w - k)]
            x = remap_dim(x, d, [g for g in segs if g.length], what="torch.roll")
        else:
            local_s.append(s)
            local_d.append(d)
    return _run_local(x, lambda t: torch.roll(t, local_s, local_d)) if local_d else x
