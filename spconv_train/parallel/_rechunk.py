"""Re-chunk a sharded dim (every output element a copy of an input element or a fill, by
point-to-point messages only: a map of ``Segment``s, received as hulls per owner and picked by
``index_select``), and the ops that are one: ``F.pad`` (every mode; negative amounts crop),
basic slicing (other index forms: DTensor's rules), ``flip`` and ``roll``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._dims import handled, index_shape, is_dp, local_of, mesh_axis, norm_dim, sharded_dims, wrap
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds
from ._halo import gather_columns
from ._mode import register_handler
from ._prefix_shard import reduced_placements


@dataclass(frozen=True)
class Segment:
    """``length`` output columns reading input columns ``start + i * step`` (step 0 repeats,
    -1 mirrors), or the fill value when ``start`` is None."""

    start: int | None
    length: int
    step: int = 1


@dataclass(frozen=True)
class RemapPlan:
    """The exchange and per rank each output column's place in the received buffer (None:
    the buffer as it is), and whether a fill column follows the buffer."""

    exchange: ExchangePlan
    out_width: int
    index: tuple[tuple[int, ...] | None, ...]
    fills: tuple[bool, ...]


@functools.lru_cache(maxsize=1024)
def plan_remap(width: int, parts: int, segments: tuple[Segment, ...]) -> RemapPlan:
    """Plan the re-chunk of a ``width``-column input over ``parts`` ranks into ``segments``."""
    out_width = sum(s.length for s in segments)
    owned = all_shard_bounds(width, parts)
    needed, index, fills = [], [], []
    for o0, o1 in all_shard_bounds(out_width, parts):
        src, pos = [], 0  # the input column (-1: fill) of every output column in [o0, o1)
        for seg in segments:
            for j in range(max(o0, pos), min(o1, pos + seg.length)):
                src.append(-1 if seg.start is None else seg.start + (j - pos) * seg.step)
            pos += seg.length
        for c in src:
            if not -1 <= c < width:
                raise ValueError(f"re-chunk map reads column {c} of a {width}-column input")
        hulls, total = [], 0  # (offset in the buffer, lo, hi) per owner read
        for a, b in owned:
            mine = [c for c in src if a <= c < b]
            if mine:
                hulls.append((total, min(mine), max(mine) + 1))
                total += max(mine) + 1 - min(mine)
        where = [
            total if c < 0 else next(o + c - a for o, a, b in hulls if a <= c < b) for c in src
        ]
        needed.append(tuple((a, b) for _, a, b in hulls))
        index.append(None if where == list(range(total)) else tuple(where))  # (no fill then)
        fills.append(any(c < 0 for c in src))
    plan = ExchangePlan(width, tuple(owned), tuple(needed))
    return RemapPlan(plan, out_width, tuple(index), tuple(fills))


def rechunk_axes(x: DTensor) -> dict[int, tuple[int, int, object]]:
    """``{tensor dim: (parts, rank, group)}`` of each non-batch dim a non-``dp`` mesh dim splits."""
    mesh = x.device_mesh
    return {d: mesh_axis(mesh, m) for d, m in sharded_dims(x).items() if d > 0 and not is_dp(x, m)}


def remap_dims(x: DTensor, maps: dict, value: float = 0.0, then=None, shape=None):
    """``x`` with dim ``d`` holding ``maps[d]`` per ``d``; ``then``: a local op afterwards."""
    axes = rechunk_axes(x)
    local = x.to_local()
    for d, segments in maps.items():
        parts, rank, group = axes.get(d, (1, 0, None))
        plan = plan_remap(x.shape[d], parts, tuple(segments))
        fill, index = int(plan.fills[rank]), plan.index[rank]
        g = gather_columns(local.movedim(d, -1), plan.exchange, rank, group, 0, fill, value)
        if index is not None:
            g = g.index_select(-1, torch.tensor(index, dtype=torch.long, device=g.device))
        local = g.movedim(-1, d)
    if shape is None:
        shape = [sum(s.length for s in maps[d]) if d in maps else n for d, n in enumerate(x.shape)]
    out = then(local) if then else local
    # contiguous: a view of the result (Swin's window partition after its pad) reads the
    # local tensor as DTensor takes it to be, row-major
    return wrap(out.contiguous(), x, x.placements, tuple(shape))


def _expand_index(index, ndim: int):
    """``index`` as one entry per dim (ints and slices), or None if it has other forms."""
    items = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(i, (int, slice)) and i is not Ellipsis for i in items):
        return None
    if any(isinstance(i, bool) for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        k, fill = items.index(Ellipsis), ndim - (len(items) - 1)
        items = (*items[:k], *(slice(None),) * fill, *items[k + 1 :])
    items = (*items, *(slice(None),) * (ndim - len(items)))
    return items if len(items) == ndim else None


def _split(x, dims) -> list[int] | None:
    """The sharded dims among ``dims`` a re-chunk moves, or None when ``dims`` touch another
    sharded dim (the batch: DTensor's own rules, watched by the no-gather guard)."""
    where, axes = sharded_dims(x), rechunk_axes(x)
    remapped = [d for d in dims if d in axes]
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
    spans = {d: range(*items[d].indices(x.shape[d])) for d in remapped}
    maps = {d: [Segment(r.start, len(r), r.step)] if len(r) else [] for d, r in spans.items()}
    items = tuple(slice(None) if d in maps else i for d, i in enumerate(items))
    x = remap_dims(x, maps) if maps else x
    if all(i == slice(None) for i in items):
        return x
    removed = tuple(d for d, i in enumerate(items) if isinstance(i, int))  # dims ints drop
    return wrap(local_of(x)[items], x, reduced_placements(x, removed), index_shape(x.shape, items))


@register_handler(torch.flip, torch.Tensor.flip)
def spatial_flip(x, *dims, **kwargs):
    """``torch.flip`` / ``x.flip``: along a sharded dim a mirroring re-chunk."""
    given = _dims_list(kwargs["dims"] if "dims" in kwargs else dims[0] if len(dims) == 1 else dims)
    wanted = [norm_dim(d, x.ndim) for d in _dims_list(given)] if handled(x) else []
    remapped = _split(x, wanted) if handled(x) else None
    if remapped is None:
        return torch.flip(x, given)
    n, rest = x.shape, [d for d in wanted if d not in remapped]
    maps = {d: [Segment(n[d] - 1, n[d], -1)] for d in remapped}
    return remap_dims(x, maps, then=(lambda t: torch.flip(t, rest)) if rest else None)


@register_handler(torch.roll, torch.Tensor.roll)
def spatial_roll(x, shifts, dims=None):
    """``torch.roll`` along given dims; along a sharded one a re-chunk with wrap-around."""
    if dims is None or not handled(x):
        return torch.roll(x, shifts, dims)
    shifts_l, dims_l = _dims_list(shifts), [norm_dim(d, x.ndim) for d in _dims_list(dims)]
    remapped = _split(x, dims_l) if len(shifts_l) == len(dims_l) else None
    if remapped is None:
        return torch.roll(x, shifts, dims)
    pairs = list(zip(shifts_l, dims_l, strict=True))
    maps: dict[int, list[Segment]] = {}
    for d in remapped:  # rolls along one dim add up
        n, k = x.shape[d], sum(s for s, e in pairs if e == d) % x.shape[d]
        maps[d] = [g for g in (Segment(n - k, k), Segment(0, n - k)) if g.length]
    rest = [(s, d) for s, d in pairs if d not in remapped]
    then = (lambda t: torch.roll(t, *map(list, zip(*rest, strict=True)))) if rest else None
    return remap_dims(x, maps, then=then)


def _pad_segments(width: int, left: int, right: int, mode: str) -> list:
    """Re-chunk map of padding a dim of ``width`` by ``left``/``right`` (negative: crop)."""
    a, b = max(0, -left), width - max(0, -right)
    if b <= a:
        raise SpatialShardingError(f"F.pad: cropping ({left}, {right}) leaves no column of {width}")
    pl, pr = max(left, 0), max(right, 0)
    mid = Segment(a, b - a)
    if mode == "constant":
        sides = Segment(None, pl), Segment(None, pr)  # fills
    elif mode == "reflect":
        sides = Segment(pl, pl, -1), Segment(width - 2, pr, -1)
    elif mode == "replicate":
        sides = Segment(0, pl, 0), Segment(width - 1, pr, 0)
    else:  # circular wraps within the cropped part, as torch does
        sides = Segment(b - pl, pl), Segment(a, pr)
    return [s for s in (sides[0], mid, sides[1]) if s.length]


@functools.lru_cache(maxsize=1024)
def _out_shape(shape: tuple[int, ...], pad: tuple[int, ...], mode: str, value) -> tuple:
    """torch's own checks and output shape of the pad, on a meta tensor, once per geometry."""
    return tuple(F.pad(torch.empty(shape, device="meta"), pad, mode, value).shape)


@register_handler(F.pad, torch._C._nn.pad)
def spatial_pad(input, pad, mode: str = "constant", value=None):
    """``F.pad`` of a sharded image or volume: sharded dims re-chunked, the others local."""
    if not handled(input) or input.ndim not in (4, 5):
        return F.pad(input, pad, mode, value)
    pad, ndim = [int(p) for p in pad], input.ndim
    shape = _out_shape(tuple(input.shape), tuple(pad), mode, value)
    batch = 2 * (ndim - 1)  # F.pad's entries from here on pad the batch dim
    if len(pad) > batch and any(pad[batch:]) and 0 in sharded_dims(input):
        raise SpatialShardingError(
            "F.pad: padding the batch dimension of a batch-sharded tensor is not supported"
        )
    rest, maps = list(pad), {}
    for d in _split(input, range(1, ndim)):  # the sharded dims (channels-last: from 1)
        i = 2 * (ndim - 1 - d)  # F.pad lists the last dim first
        if any(pad[i : i + 2]):
            maps[d] = _pad_segments(input.shape[d], *pad[i : i + 2], mode)
            rest[i : i + 2] = (0, 0)
    args = (rest, mode, value) if mode == "constant" else (rest, mode)
    then = (lambda t: F.pad(t, *args)) if any(rest) else None
    v = 0.0 if value is None else float(value)
    return remap_dims(input, maps, v, then, shape)
