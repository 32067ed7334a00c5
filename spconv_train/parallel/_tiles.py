"""A window op's input window over every sharded axis (``tile_window``; ``halo_window`` for op
authors): W, then H *on the W window*, then D: corners from neighbours only (docs/tiles.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._dims import mesh_axis
from ._geometry import SpatialShardingError, window_out_size
from ._sharding import SpatialLayout, enter, leave, spatial_layout
from ._window import PAD_MODES, WindowPlan, gather_window, plan_window, saving_steps_by_reference

#: one spatial dim's window geometry: kernel, stride, dilation, padding before, padding after
Geom = tuple[int, int, int, int, int]
IntOrSeq = int | Sequence[int]


def layout_axes(layout: SpatialLayout | None) -> tuple[tuple[int, int], ...]:
    """``(tensor dim, mesh dim)`` of every sharded spatial dim of any layout, in order."""
    if layout is None:
        return ()
    if layout.axes:
        return layout.axes
    return ((layout.dim, layout.sp_dim),) if layout.width_sharded else ()


def sharded_axes(layout: SpatialLayout | None) -> list[tuple[int, int, int, object]]:
    """``(tensor dim, parts, rank, group)`` of every sharded spatial dim, in order."""
    return [(d, *mesh_axis(layout.mesh, m)) for d, m in layout_axes(layout)]


def along(t: Tensor, d: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` applied to ``t`` with dim ``d`` moved last (a view), the result moved back."""
    if d % t.ndim == t.ndim - 1:  # already last (the width of strips): no permute views
        return fn(t)
    return fn(t.movedim(d, -1)).movedim(-1, d)


def ceil_geom(size: int, k: int, s: int, d: int, p: int, ceil_mode: bool) -> Geom:
    """A pooling dim's geometry with ``ceil_mode`` as extra padding after (same output size)."""
    out = window_out_size(size, k, s, d, p, p, ceil_mode)
    return k, s, d, p, max(p, (out - 1) * s + d * (k - 1) + 1 - size - p)


@dataclass(frozen=True)
class HaloWindow:
    """This rank's input window ``local`` for a window op (local part + halos + edge padding:
    run the op on it with padding 0), and the way back to the output DTensor. Per spatial
    tensor dim: the global output size, the output positions this rank computes, the global
    input index of the window's first element (may be negative). ``recipe``: ``(source, steps,
    value)`` when the exchanges ``steps`` alone built it from ``source`` (edges of ``value``)."""

    local: Tensor
    layout: SpatialLayout | None  # None: a plain tensor
    input_shape: tuple[int, ...]
    out_sizes: dict[int, int]
    out_ranges: dict[int, tuple[int, int]]
    starts: dict[int, int]
    what: str = "halo_window"
    recipe: tuple[Tensor, tuple, float] | None = None

    @property
    def grad_groups(self) -> tuple:
        """Groups to sum a parameter gradient computed on it over (``sum_grad_over``)."""
        return self.layout.grad_groups if self.layout is not None else ()

    def wrap(self, out: Tensor) -> Tensor:
        """The op's local result on ``local`` as the output DTensor (a plain tensor as it is)."""
        for d, (lo, hi) in self.out_ranges.items():
            if out.ndim != len(self.input_shape) or out.shape[d] != hi - lo:
                raise SpatialShardingError(
                    f"{self.what}: the local result has shape {tuple(out.shape)}; dim {d} must "
                    f"hold this rank's {hi - lo} output positions (run the op on "
                    f"HaloWindow.local with padding 0 and the same kernel, stride, dilation)"
                )
        return out if self.layout is None else self.output(out)

    def output(self, out: Tensor) -> Tensor:
        """``wrap`` unchecked, of a DTensor's window: ``out`` in the output's global shape."""
        shape = [self.input_shape[0], *out.shape[1:]]
        for d, n in self.out_sizes.items():
            shape[d] = n
        return leave(out, self.layout, tuple(shape))

    def saving(self):
        """Context: the window saved by reference (``saving_steps_by_reference``) if it can be."""
        if self.recipe is None or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return saving_steps_by_reference(self.local, *self.recipe)


def tile_window(
    local: Tensor,
    shape: tuple[int, ...],
    layout: SpatialLayout | None,
    what: str,
    geoms: dict[int, Geom],
    mode: str = "zeros",
    value: float = 0.0,
    pad_local: bool = True,
    plan: Callable[..., WindowPlan] | None = None,
) -> HaloWindow:
    """This rank's window (halos, corners, edges padded in ``mode``) for an op of ``geoms``, to
    run with padding 0 and ``ceil_mode`` off (``pad_local=False``: unsharded dims as is);
    ``plan(what, size, parts, *geom)`` for a sharded dim instead of ``plan_window``."""
    t, sizes, ranges, starts, steps, cropped = local, {}, {}, {}, [], False
    axes = {d: (parts, rank, group) for d, parts, rank, group in sharded_axes(layout)}
    for d in sorted(geoms, reverse=True):  # W first, then H including the W halo: corners
        if d not in axes:
            k, s, dil, lo, hi = geoms[d]
            out = window_out_size(shape[d], k, s, dil, lo, hi)
            sizes[d], ranges[d], starts[d] = out, (0, out), -lo
            continue
        parts, rank, _ = ax = axes[d]
        args = (what, shape[d], parts, *geoms[d])
        wp = plan(*args) if plan else plan_window(*args, mode)
        t = along(t, d, lambda m, wp=wp, ax=ax: gather_window(m, wp, *ax[1:], mode, value))
        steps.append((d, wp, rank, t))
        cropped = cropped or any(wp.edges[rank][2:])
        sizes[d], ranges[d], starts[d] = wp.out_width, wp.out_bounds[rank], wp.starts[rank]
    pads: list[int] = []
    for d in range(t.ndim - 1, 1, -1):  # F.pad lists the last dim first
        pads += geoms[d][3:5] if pad_local and d in geoms and d not in axes else (0, 0)
    constant = mode in ("zeros", "constant")
    if any(pads):
        t = F.pad(t, pads, mode="constant", value=value) if constant else F.pad(t, pads, mode=mode)
    reshaped = cropped or any(pads) or not constant  # (padded or cropped after the exchanges)
    recipe = None if reshaped or not steps else (local, tuple(steps), value)
    return HaloWindow(t, layout, shape, sizes, ranges, starts, what, recipe)


def _geoms(ndim: int, kernel, stride, padding, dilation, what: str) -> dict[int, Geom]:
    """``{tensor dim: (kernel, stride, dilation, pad_lo, pad_hi)}`` of every spatial dim."""
    n = ndim - 2
    per_dim = {"kernel": kernel, "stride": stride, "dilation": dilation, "padding": padding}
    for name, v in per_dim.items():
        per_dim[name] = [v] * n if isinstance(v, int) else list(v)
        if len(per_dim[name]) != n:
            raise SpatialShardingError(
                f"{what}: {name}={v!r} needs one entry per spatial dim ({n}) or a single int"
            )
    ks, ss, ds, ps = per_dim.values()
    pads = [(p, p) if isinstance(p, int) else tuple(p) for p in ps]
    if any(len(p) != 2 or min(p) < 0 for p in pads) or min(ks + ss + ds) < 1:
        raise SpatialShardingError(
            f"{what}: kernel, stride, dilation must be >= 1 and padding >= 0 (an int or a "
            f"(before, after) pair per dim), got kernel={kernel}, stride={stride}, "
            f"dilation={dilation}, padding={padding}"
        )
    return {2 + i: (ks[i], ss[i], ds[i], *pads[i]) for i in range(n)}


def halo_window(
    x: Tensor,
    kernel: IntOrSeq,
    stride: IntOrSeq = 1,
    padding: IntOrSeq | Sequence[tuple[int, int]] = 0,
    dilation: IntOrSeq = 1,
    padding_mode: str = "zeros",
    value: float = 0.0,
    what: str = "halo_window",
) -> HaloWindow:
    """This rank's input window for a window op of the given geometry on ``x`` (any layout,
    replicated, or a plain tensor; arguments: docs/extending.md). Differentiable. Raises
    ``SpatialShardingError`` naming ``what`` for a part narrower than its halo or without output."""
    if padding_mode not in PAD_MODES:
        raise SpatialShardingError(
            f"{what}: padding_mode {padding_mode!r} is not one of {list(PAD_MODES)}"
        )
    geoms = _geoms(x.ndim, kernel, stride, padding, dilation, what)
    layout = None
    if isinstance(x, DTensor):
        x, layout = spatial_layout(x, what, ndim=x.ndim, tiles=True)
    local = enter(x) if layout is not None else x
    return tile_window(local, tuple(x.shape), layout, what, geoms, padding_mode, value)
