"""Adaptive 3-D pools (``F.adaptive_avg_pool3d``, ``F.adaptive_max_pool3d`` and their modules)
on an NCDHW volume sharded along one of D, H, W.

An adaptive window is a box: a range along each dim (PyTorch's rule, ``adaptive_bounds``), so
the pool is separable. Every rank first pools its block over the two local dims (keeping its
planes along the sharded dim: an adaptive pool to the same size is the identity), then
reduces the sharded dim by windows of planes, as ``_pool.py`` does for the width of images:

- output size > 1 along the sharded dim: the output keeps the input's ``Shard`` (DTensor
  chunking; a rank may get no output plane), and each rank fetches the pooled planes its
  windows read (a halo exchange of already pooled planes). When a window would read planes
  beyond the neighbouring blocks (many ranks, few output planes) it is refused clearly
  rather than gathered;
- output size 1 along the sharded dim (a global pool there): each rank reduces its own
  planes and a small all-reduce over the spatial group combines them; the output is
  ``Replicate`` on the "sp" mesh dimension.

``return_indices`` is refused (no ``MaxUnpool3d`` on volumes either).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from ._geometry import SpatialShardingError, all_shard_bounds
from ._halo import gather_columns
from ._parallelize import register_spatial_module
from ._pool import (
    _adaptive_exchange,
    _own_segments,
    _register,
    _segment_max,
    _segment_sums,
    _SumReplicated,
    _what,
    adaptive_bounds,
)
from ._sharding import SpatialLayout, enter, leave, run_unsharded
from ._volume import volume_layout


def _out_size(output_size, shape) -> tuple[int, int, int]:
    """``output_size`` (an int or a 3-sequence, ``None`` = keep that size) as three ints."""
    size = (output_size,) * 3 if isinstance(output_size, int) else tuple(output_size)
    if len(size) != 3:
        raise ValueError(f"adaptive 3-D pool: output_size {output_size} must give 3 sizes")
    return tuple(int(o) if o is not None else n for o, n in zip(size, shape, strict=True))  # type: ignore[return-value]


def _reduce_planes(t: Tensor, segs, lens: list[int], kind: str) -> Tensor:
    """Reduce the last dim of ``t`` over the plane segments ``segs`` (local indices);
    averages divide by ``lens``, the global window sizes."""
    if not segs:  # no output plane here: an empty slice keeps the exchange in the graph
        return t.narrow(-1, 0, 0)
    if kind == "avg":
        div = torch.tensor(lens, dtype=t.dtype, device=t.device)
        return _segment_sums(t, segs) / div
    return _segment_max(t, segs)[0]


def _adaptive_pool3d(x: DTensor, output_size, kind: str, return_indices: bool, what: str):
    """Adaptive ``kind`` ("avg"/"max") pooling of a volume sharded along D, H or W."""
    out = _out_size(output_size, tuple(x.shape[2:]))
    if min(out) < 1:
        raise ValueError(f"{what}: output size must be positive, got {output_size}")
    if return_indices:
        raise SpatialShardingError(
            f"{what}: return_indices is not supported on a sharded volume (no MaxUnpool3d "
            f"either); use the values only"
        )
    pool = F.adaptive_avg_pool3d if kind == "avg" else F.adaptive_max_pool3d
    x, layout = volume_layout(x, what, tiles=True)
    if layout.is_tile:  # two or three of D, H, W sharded: small outputs, replicated
        from ._tiles_ops import tile_adaptive_pool

        return tile_adaptive_pool(x, layout, tuple(out), kind, False, what)
    if not layout.width_sharded:
        return run_unsharded(x, layout, lambda t: pool(t, out))
    d, i = layout.dim, layout.dim - 2
    n, rank, group, size, o = layout.sp_size, layout.sp_rank, layout.sp_group, x.shape[d], out[i]
    shape = [x.shape[0], *x.shape[1:2], *out]
    local = enter(x)
    a, b = all_shard_bounds(size, n)[rank]
    halo = o > 1
    if b == a and not halo:  # empty block: one neutral plane keeps the local ops defined
        neutral = 0.0 if kind == "avg" else float("-inf")
        local = F.pad(local.movedim(d, -1), (0, 1), value=neutral).movedim(-1, d)
    keep = list(out)
    keep[i] = local.shape[d]
    pooled = pool(local, keep).movedim(d, -1)  # local dims pooled, planes kept (last)
    if halo:
        plan = _adaptive_exchange(what, size, o, n)
        g = gather_columns(pooled, plan, rank, group)
        start = plan.needed[rank][0][0] if plan.needed[rank] else 0
        o0, o1 = all_shard_bounds(o, n)[rank]
        win = adaptive_bounds(size, o, o0, o1)
        segs = tuple((s - start, e - start) for s, e in win)
        v = _reduce_planes(g, segs, [e - s for s, e in win], kind)
        return leave(v.movedim(-1, d), layout, tuple(shape))
    # Reduce path: partial results over this rank's own planes for every output plane.
    win = adaptive_bounds(size, o)
    segs = _own_segments(win, a, b)
    v = _reduce_planes(pooled, segs, [e - s for s, e in win], kind)
    sp, pl = layout.sp_dim, layout.placements
    rep = SpatialLayout(layout.mesh, (*pl[:sp], Replicate(), *pl[sp + 1 :]), sp)
    if kind == "avg":
        v = _SumReplicated.apply(v, group) if n > 1 else v
        return leave(v.movedim(-1, d), rep, tuple(shape))
    mine = torch.tensor([e > s for s, e in segs], device=v.device)  # a non-empty window part
    best = v.detach().clone()
    dist.all_reduce(best, dist.ReduceOp.MAX, group=group)
    # ties between ranks: the lowest rank (first planes) wins; only it passes the gradient
    big = torch.iinfo(torch.int64).max
    cand = torch.where(mine & (v.detach() == best), rank, big)
    dist.all_reduce(cand, dist.ReduceOp.MIN, group=group)
    v = torch.where(cand == rank, v, best)
    return leave(v.movedim(-1, d), rep, tuple(shape))


def spatial_adaptive_avg_pool3d(x: DTensor, output_size, what: str = "adaptive_avg_pool3d"):
    """``F.adaptive_avg_pool3d`` on a sharded volume: the input's ``Shard`` when every rank
    gets an output plane, else ``Replicate`` on the sp mesh dimension (global pooling)."""
    return _adaptive_pool3d(x, output_size, "avg", False, what)


def spatial_adaptive_max_pool3d(
    x: DTensor, output_size, return_indices: bool = False, what: str = "adaptive_max_pool3d"
):
    """``F.adaptive_max_pool3d`` on a sharded volume (placements as for the average)."""
    return _adaptive_pool3d(x, output_size, "max", return_indices, what)


@register_spatial_module(nn.AdaptiveAvgPool3d)
class SpatialAdaptiveAvgPool3d(nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d`` on a volume sharded along D, H or W."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return super().forward(x)
        return spatial_adaptive_avg_pool3d(x, self.output_size, what=_what(self))


@register_spatial_module(nn.AdaptiveMaxPool3d)
class SpatialAdaptiveMaxPool3d(nn.AdaptiveMaxPool3d):
    """``nn.AdaptiveMaxPool3d`` on a volume sharded along D, H or W (values only)."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return super().forward(x)
        size, ri = self.output_size, self.return_indices
        return spatial_adaptive_max_pool3d(x, size, ri, what=_what(self))


_nn = torch._C._nn
_register(spatial_adaptive_avg_pool3d, F.adaptive_avg_pool3d, _nn.adaptive_avg_pool3d)
_register(spatial_adaptive_max_pool3d, F.adaptive_max_pool3d)
_register(
    spatial_adaptive_max_pool3d,
    F.adaptive_max_pool3d_with_indices,
    _nn.adaptive_max_pool3d,
    pair_after=2,
)
