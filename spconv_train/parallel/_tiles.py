"""H x W tiles: an NCHW image sharded along H and W over a 2-D spatial mesh.

``[Shard(2), Shard(3)]`` on a ``(sp_h, sp_w)`` mesh (``[Shard(0), Shard(2), Shard(3)]`` on
``(dp, sp_h, sp_w)``) gives every rank a tile; ``SpatialLayout.axes`` lists the
``(tensor dim, mesh dim)`` of each sharded spatial dim. No new halo code: the one-dim window
machinery (``plan_window``, ``gather_window``, ``gather_columns``) works along the last
tensor dim, so a tile op moves one sharded dim last at a time (``along``), as every layout
does (a volume sharded along D or H too). The halo is fetched along W first over the ``sp_w`` group,
then along H over the ``sp_h`` group *on the W window*, halo columns included: the H
neighbour's W halo is the diagonal neighbour's data, so the corners arrive in two
neighbour-only exchanges. The backward is the adjoint of that composition (autograd chains
the two exchanges' adjoints). Padding is separable per dim, so padding each sharded dim
inside its exchange and the unsharded ones locally equals padding all at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._geometry import window_out_size
from ._sharding import SpatialLayout
from ._window import WindowStep, gather_window, plan_window, saving_steps_by_reference

#: one spatial dim's window geometry: kernel, stride, dilation, padding before, padding after
Geom = tuple[int, int, int, int, int]


def layout_axes(layout: SpatialLayout) -> tuple[tuple[int, int], ...]:
    """``(tensor dim, mesh dim)`` of every sharded spatial dim of any layout, in tensor-dim
    order: a tile's or block's axes, a strip's one axis, none for a spatially replicated
    input. Ops written over this list run on every layout (strips are the one-axis case)."""
    if layout.axes:
        return layout.axes
    return ((layout.dim, layout.sp_dim),) if layout.width_sharded else ()


def axis_of(layout: SpatialLayout, d: int) -> tuple[int, int, object] | None:
    """``(parts, rank, group)`` of the mesh dimension sharding tensor dim ``d`` of any
    layout (``layout_axes``), or ``None`` when ``d`` is not sharded."""
    for td, m in layout_axes(layout):
        if td == d:
            return layout.mesh.size(m), layout.mesh.get_local_rank(m), layout.mesh.get_group(m)
    return None


def sharded_axes(layout: SpatialLayout) -> list[tuple[int, int, int, object]]:
    """``(tensor dim, parts, rank, group)`` of every sharded spatial dim of any layout,
    in tensor-dim order (for ops that are separable per dim: one 1-D step per dim)."""
    return [(d, *axis_of(layout, d)) for d, _ in layout_axes(layout)]


def along(t: Tensor, d: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` applied to ``t`` with dim ``d`` moved last (a view), the result moved back."""
    return fn(t.movedim(d, -1)).movedim(-1, d)


def ceil_geom(size: int, k: int, s: int, d: int, p: int, ceil_mode: bool) -> Geom:
    """A pooling dim's geometry with ``ceil_mode`` turned into extra padding after (the
    positions the last ceil window overhangs), so the plain floor rule gives the same size."""
    out = window_out_size(size, k, s, d, p, p, ceil_mode)
    return k, s, d, p, max(p, (out - 1) * s + d * (k - 1) + 1 - size - p)


@dataclass(frozen=True)
class TileWindow:
    """A tile's window and where its outputs go, per spatial tensor dim."""

    window: Tensor
    #: global output size per spatial dim
    out_sizes: dict[int, int]
    #: this rank's global output range per spatial dim
    out_ranges: dict[int, tuple[int, int]]
    #: global input index of the window's first element per spatial dim (may be negative)
    starts: dict[int, int]
    #: the exchanges that built ``window`` from the local tile, in order (W, then H, then D)
    steps: tuple[WindowStep, ...] = ()
    #: ``window`` is not just the chain of ``steps`` (padded locally afterwards, or cropped)
    reshaped: bool = True


def tile_window(
    local: Tensor,
    shape: tuple[int, ...],
    layout: SpatialLayout,
    what: str,
    geoms: dict[int, Geom],
    mode: str = "zeros",
    value: float = 0.0,
    pad_local: bool = True,
) -> TileWindow:
    """This rank's window (halos and corners fetched, every image edge padded in ``mode``)
    for a window op of geometry ``geoms`` (one per spatial tensor dim of the global
    ``shape``). The local op then runs with padding 0 and ``ceil_mode`` off. Differentiable.
    ``pad_local=False`` leaves the padding of the dims no mesh dim shards to the local op.
    Raises ``SpatialShardingError`` (naming ``what``) for tiles narrower than the halo."""
    t = local
    sizes, ranges, starts = {}, {}, {}
    steps, cropped = [], False
    for d in sorted(geoms, reverse=True):  # W first, then H including the W halo: corners
        k, s, dil, lo, hi = geoms[d]
        ax = axis_of(layout, d)
        if ax is None:
            out = window_out_size(shape[d], k, s, dil, lo, hi)
            sizes[d], ranges[d], starts[d] = out, (0, out), -lo
            continue
        parts, rank, group = ax
        wp = plan_window(what, shape[d], parts, k, s, dil, lo, hi, mode)
        t = along(
            t, d, lambda m, wp=wp, rank=rank, group=group: _gather(m, wp, rank, group, mode, value)
        )
        pl, pr, cl, cr = wp.edges[rank]
        steps.append(WindowStep(d, wp.exchange, rank, pl, pr, t))
        cropped = cropped or bool(cl or cr)
        o0, o1 = wp.out_bounds[rank]
        sizes[d], ranges[d], starts[d] = wp.out_width, (o0, o1), o0 * s - lo
    pads: list[int] = []
    for d in range(t.ndim - 1, 1, -1):  # F.pad lists the last dim first
        local_pad = pad_local and d in geoms and axis_of(layout, d) is None
        pads += list(geoms[d][3:5]) if local_pad else [0, 0]
    if any(pads):
        if mode in ("zeros", "constant"):
            t = F.pad(t, pads, mode="constant", value=value)
        else:
            t = F.pad(t, pads, mode=mode)
    reshaped = cropped or any(pads) or mode not in ("zeros", "constant")
    return TileWindow(t, sizes, ranges, starts, tuple(steps), reshaped)


def saving_tile_window(tw: TileWindow, local: Tensor, value: float = 0.0):
    """While active, an op that saves ``tw.window`` for its backward keeps the local tile by
    reference plus the thin halo slabs of every exchange (edges and corners) instead of the
    window copy, and rebuilds the window in the backward (``_window.saving_steps_by_reference``).
    A no-op context for a window padded locally, cropped or built in a non-constant mode."""
    if tw.reshaped or not tw.steps or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    return saving_steps_by_reference(tw.window, local, tw.steps, value)


def _gather(m: Tensor, wp, rank: int, group, mode: str, value: float) -> Tensor:
    """``gather_window`` of a tile with the dim to exchange last (``F.pad``'s reflect,
    replicate and circular modes pad the last dims of a 3-D or 4-D tensor only)."""
    shape = m.shape
    if m.ndim > 4 and mode not in ("zeros", "constant"):
        m = m.flatten(1, m.ndim - 3)
    g = gather_window(m, wp, rank, group, mode, value)
    return g.reshape(*shape[:-1], g.shape[-1])


def tile_shape(x_shape: tuple[int, ...], out: Tensor, tw: TileWindow) -> tuple[int, ...]:
    """Global shape of a window op's output ``out``: global batch, the spatial dims' global
    output sizes, the other dims as computed."""
    shape = [x_shape[0], *out.shape[1:]]
    for d, n in tw.out_sizes.items():
        shape[d] = n
    return tuple(shape)
