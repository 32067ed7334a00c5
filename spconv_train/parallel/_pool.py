"""Max, average and adaptive pooling of any spatial rank on every layout, their modules and
torch-function routes. Max / average: the local op on ``tile_window``'s window (ties as on one
device, global indices, torch's divisor from *global* positions). Adaptive, separable per dim:
*halo* (one sharded dim pooled to more than one cell: the input's ``Shard``) or *reduce*
(global and small pools: parts all-reduced, ``Replicate``; max by value, then the smallest
global index, whose rank alone passes the gradient). docs/tiles.md, docs/volumes.md.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds, check_strips, ntuple
from ._halo import gather_columns
from ._mode import register_handler, spatial_module
from ._reduce import all_reduce_extreme
from ._sharding import SpatialLayout, enter, leave, spatial_layout
from ._small_sum import sum_replicated
from ._tiles import along, ceil_geom, layout_axes, sharded_axes, tile_shape, tile_window

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
    default = stride is None or stride == [] or stride == ()  # torch's; 0 is refused, as by torch
    stride = kernel_size if default else stride
    k, s, p, d = [ntuple(v, rank) for v in (kernel_size, stride, padding, dilation)]
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
    what: str,
):
    """``F.max_pool{rank}d`` of a DTensor on any layout (indices global, as torch's)."""
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
    what: str,
) -> DTensor:
    """``F.avg_pool{rank}d`` of a DTensor on any layout."""
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


Segments = tuple[tuple[int, int], ...]
#: per spatial dim: window segments in local indices, global index of local index 0, and
#: the global window lengths (the divisors of an average)
DimPlan = tuple[Segments, int, tuple[int, ...]]
#: torch's adaptive average per tensor rank (it reduces the dims no mesh dim shards)
_ADAPTIVE_AVG = {3: F.adaptive_avg_pool1d, 4: F.adaptive_avg_pool2d, 5: F.adaptive_avg_pool3d}


def adaptive_bounds(size: int, out: int, lo: int, hi: int) -> Segments:
    """Input ``[start, end)`` of adaptive-pooling outputs ``[lo, hi)`` (PyTorch's rule)."""
    return tuple(((j * size) // out, -(-((j + 1) * size) // out)) for j in range(lo, hi))


@functools.lru_cache(maxsize=1024)
def _adaptive_exchange(what: str, width: int, out: int, parts: int) -> ExchangePlan:
    """Input planes each rank gathers for its chunk of ``out`` adaptive outputs."""
    owned = check_strips(what, width, parts, "input")
    windows = (adaptive_bounds(width, out, *chunk) for chunk in all_shard_bounds(out, parts))
    plan = ExchangePlan(
        width, tuple(owned), tuple(((w[0][0], w[-1][1]),) if w else () for w in windows)
    )
    plan.check_neighbours(what)
    return plan


def _segment_sums(g: Tensor, segs: Segments) -> Tensor:
    """Sums of ``g`` over segments of its last dim (local indices), last dim = segment."""
    if segs == ((0, g.shape[-1]),):
        return g.sum(-1, keepdim=True)
    if not segs:
        return g.narrow(-1, 0, 0)
    # float64 prefix sums: the differences of neighbouring prefixes stay exact to fp32
    c = F.pad(g.double().cumsum(-1), (1, 0))
    starts = torch.tensor([s for s, _ in segs], device=g.device)
    ends = torch.tensor([e for _, e in segs], device=g.device)
    return (c.index_select(-1, ends) - c.index_select(-1, starts)).to(g.dtype)


def _segment_max(g: Tensor, segs: Segments) -> tuple[Tensor, Tensor]:
    """Max over segments of the last dim and its first index (empty: ``-inf`` at the end)."""
    w = g.shape[-1]
    if w and segs == ((0, w),):
        return g.max(-1, keepdim=True)  # the first maximum, as documented
    if not segs:
        return g.narrow(-1, 0, 0), torch.zeros_like(g.narrow(-1, 0, 0), dtype=torch.long)
    length = max(1, *(e - s for s, e in segs))
    # every segment padded to the same length by repeating its last element (a repeat never
    # wins: max() returns the first maximum), empty segments read the -inf element w
    idx = torch.tensor(
        [[s + min(t, e - s - 1) if e > s else w for t in range(length)] for s, e in segs],
        device=g.device,
    )
    gp = F.pad(g, (0, 1), value=float("-inf"))
    vals = gp.index_select(-1, idx.flatten()).unflatten(-1, idx.shape)
    v, arg = vals.max(-1)
    return v, idx.expand(*arg.shape, length).gather(-1, arg.unsqueeze(-1)).squeeze(-1)


@functools.lru_cache(maxsize=1024)
def _plan(sizes: tuple, out: tuple, axes: tuple, halo: bool) -> tuple[DimPlan, ...]:
    """``DimPlan`` per spatial dim; ``axes``: ``(j, parts, rank)``; ``halo``: the output chunk's."""
    plans = []
    for j, (n, o) in enumerate(zip(sizes, out, strict=True)):
        ax = next(((p, r) for i, p, r in axes if i == j), None)
        # halo: the windows of this rank's outputs, from the first one's start (the exchange's
        # first column); reduce: every window, cut to this rank's columns [offset, end)
        win = adaptive_bounds(n, o, *(all_shard_bounds(o, ax[0])[ax[1]] if ax and halo else (0, o)))
        offset, end = (
            (win[0][0] if win else 0, n) if halo or not ax else all_shard_bounds(n, ax[0])[ax[1]]
        )
        segs = tuple((min(max(s, offset), end) - offset, max(min(e, end), offset) - offset)
                     for s, e in win)  # fmt: skip
        plans.append((segs, offset, tuple(e - s for s, e in win)))
    return tuple(plans)


def _reduce_max(t: Tensor, plans: tuple[DimPlan, ...], sizes: tuple) -> tuple:
    """``(values, global flat index, valid)`` of the max over every window, innermost first."""
    idx, stride = None, 1
    valid = torch.ones((), dtype=torch.bool, device=t.device)
    for j in range(len(plans) - 1, -1, -1):
        (segs, offset, _), d = plans[j], j + 2
        m = t.movedim(d, -1)
        v, arg = _segment_max(m, segs)  # arg: m.shape[-1] for an empty segment
        at = arg.clamp(max=m.shape[-1] - 1)
        inner = 0 if idx is None else idx.movedim(d, -1).gather(-1, at)
        t, idx = v.movedim(-1, d), (inner + (at + offset) * stride).movedim(-1, d)
        stride *= sizes[j]
        hit = torch.tensor([e > s for s, e in segs], dtype=torch.bool, device=t.device)
        valid = valid & hit.view(-1, *(1,) * (len(plans) - 1 - j))
    return t, idx, valid


def _pool_free_dims(t: Tensor, out: tuple, sharded: set) -> Tensor:
    """torch's adaptive average over the unsharded dims (first: the halo moves less)."""
    if len(sharded) == len(out):
        return t
    keep = [t.shape[j + 2] if j in sharded else o for j, o in enumerate(out)]
    if t.numel():
        return _ADAPTIVE_AVG[t.ndim](t, keep)
    # an empty block: stay in the graph (the exchange's backward runs on every rank)
    free = [j + 2 for j in range(len(out)) if j not in sharded]
    return t.sum(free, keepdim=True).expand(*t.shape[:2], *keep)


def _reduce_avg(t: Tensor, plans: tuple[DimPlan, ...], sharded: set) -> Tensor:
    """The average over every window of the sharded dims (the others already pooled)."""
    for j in sorted(sharded, reverse=True):
        segs, _, lens = plans[j]
        div = torch.tensor(lens, dtype=t.dtype, device=t.device)
        t = along(t, j + 2, lambda m, segs=segs, div=div: _segment_sums(m, segs) / div)
    return t


def _check_small_output(x: DTensor, axes, out: tuple, kind: str, what: str) -> None:
    """Refuse a reduce over several sharded dims to more than a quarter of the smallest tile."""
    parts = {d: p for d, p, _, _ in axes}
    smallest = cells = 1
    for d in range(2, x.ndim):
        smallest *= min(b - a for a, b in all_shard_bounds(x.shape[d], parts.get(d, 1)))
        cells *= out[d - 2]
    if 4 * cells > smallest:
        raise SpatialShardingError(
            f"{what}: pooling to {'x'.join(map(str, out))} on tiles would all-reduce and "
            f"replicate an output larger than a quarter of a tile; tiles support global and "
            f"small adaptive {kind} pooling only. Shard one spatial dim for this layer's "
            f"model, or use a smaller output."
        )


def no_volume_indices(rank: int, return_indices: bool, what: str) -> None:
    """Refuse ``return_indices`` on volumes (no sharded ``MaxUnpool3d`` uses them)."""
    if return_indices and rank == 3:
        raise SpatialShardingError(
            f"{what}: return_indices is not supported on a sharded volume (no MaxUnpool3d "
            f"either); use the values only"
        )


def adaptive_pool(
    x: DTensor, output_size, return_indices: bool = False, *, rank: int, kind: str, what: str
):
    """``F.adaptive_{kind}_pool{rank}d`` (``kind``: "avg" / "max") of ``x`` on any layout."""
    size = (output_size,) * rank if isinstance(output_size, int) else tuple(output_size)
    if len(size) != rank:
        raise ValueError(f"{what}: output_size {output_size} must give {rank} sizes")
    shape = x.shape[2 : 2 + rank]
    out = tuple(int(o) if o is not None else m for o, m in zip(size, shape, strict=True))
    if min(out) < 1:
        raise ValueError(f"{what}: output size must be positive, got {output_size}")
    no_volume_indices(rank, return_indices, what)
    x, layout = spatial_layout(x, what, len(out) + 2, tiles=True)
    axes, sizes = sharded_axes(layout), tuple(x.shape[2:])
    # Images keep Replicate when some rank would get no output cell (flatten + Linear heads
    # then see one layout at every world size); volumes keep their Shard.
    halo = len(axes) == 1 and out[axes[0][0] - 2] > 1
    if halo and x.ndim < 5:
        halo = all(a < b for a, b in all_shard_bounds(out[axes[0][0] - 2], axes[0][1]))
    if len(axes) > 1:
        _check_small_output(x, axes, out, "average" if kind == "avg" else "max", what)
    key = tuple((d - 2, parts, rank) for d, parts, rank, _ in axes)
    plans = _plan(sizes, out, key, halo)
    t, sharded = enter(x), {d - 2 for d, *_ in axes}
    if kind == "avg":  # order-free: pool the unsharded dims first (the halo moves less)
        t = _pool_free_dims(t, out, sharded)
    for d, parts, rank, group in axes:
        if halo:
            plan = _adaptive_exchange(what, x.shape[d], out[d - 2], parts)
            t = along(t, d, lambda m, p=plan, r=rank, g=group: gather_columns(m, p, r, g))
        elif t.shape[d] == 0:  # empty block: one neutral element keeps the local ops defined
            neutral = 0.0 if kind == "avg" else float("-inf")
            t = along(t, d, lambda m, v=neutral: F.pad(m, (0, 1), value=v))
    shape, out_layout = (x.shape[0], x.shape[1], *out), layout
    if not halo:  # every spatial mesh dim Replicate (a dp Shard(0) kept)
        spatial = {m for _, m in layout_axes(layout)}
        pl = tuple(Replicate() if m in spatial else p for m, p in enumerate(layout.placements))
        out_layout = SpatialLayout(layout.mesh, pl, layout.sp_dim)
    if kind == "avg":
        v = _reduce_avg(t, plans, sharded)
        v = v if halo else sum_replicated(v, [group for *_, group in axes])
        return leave(v, out_layout, shape)
    v, idx, valid = _reduce_max(t, plans, sizes)
    if not halo:
        groups = [group for _, parts, _, group in axes if parts > 1]
        best = all_reduce_extreme(v.detach().clone(), groups, "max")  # a NaN as +inf
        # ties between ranks: the smallest global (row-major) index wins, as on one device;
        # a NaN wins over any number (torch propagates it), the last one by index (-1 - i)
        nan = valid & v.detach().isnan()
        top = torch.where(valid & (v.detach() == best), idx, torch.iinfo(idx.dtype).max)
        cand = torch.where(nan, -1 - idx, top)
        for group in groups:
            dist.all_reduce(cand, dist.ReduceOp.MIN, group=group)
        best = torch.where(cand < 0, float("nan"), best)
        cand = torch.where(cand < 0, -1 - cand, cand)
        v, idx = torch.where(valid & (idx == cand), v, best), cand  # only the owner: gradient
    if not return_indices:
        return leave(v, out_layout, shape)
    return leave(v, out_layout, shape), leave(idx, out_layout, shape)


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
