"""Shared plumbing of the 3-D (NCDHW) window ops: one of D, H, W sharded (``Shard(2|3|4)``).

The generic window machinery (``plan_window``, ``gather_window``, ``gather_columns``) works
along the *last* tensor dimension. A volume op moves its sharded dim last with a view
(``movedim``), fetches the halo there, and moves it back: the op then runs unchanged on the
window with padding 0 along the sharded dim. The padding of the other two (local) dims is
applied as usual (``pad_local_dims``).
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._sharding import SpatialLayout, enter, leave, spatial_layout
from ._window import WindowPlan, gather_window, saving_plain_window

Triple = tuple[int, int, int]


def triple(v) -> Triple:
    """``v`` (an int or a 3-sequence) as three ints (D, H, W)."""
    return (int(v),) * 3 if isinstance(v, int) else tuple(int(a) for a in v)  # type: ignore[return-value]


def unsharded(v: tuple, i: int) -> tuple:
    """``v`` (one value per spatial dim D, H, W) with entry ``i`` (the sharded dim) set to
    0: the padding the local op applies once the sharded dim's halo is in the window."""
    return tuple(0 if j == i else a for j, a in enumerate(v))


def volume_layout(x: DTensor, what: str, tiles: bool = False) -> tuple[DTensor, SpatialLayout]:
    """``spatial_layout`` for an NCDHW volume; ``layout.dim`` is 2, 3 or 4 (when sharded).
    A volume sharded over two or three of D, H, W is a tile layout (``layout.is_tile``):
    only ops that handle it (``_tiles_ops.py``) pass ``tiles=True``, the others refuse it
    naming themselves."""
    return spatial_layout(x, what, ndim=5, tiles=tiles)


def gather_volume_window(
    x: DTensor, layout: SpatialLayout, wp: WindowPlan, mode: str = "zeros", value: float = 0.0
) -> Tensor:
    """This rank's window of ``x`` along the sharded dim (halo fetched, image edges padded in
    ``mode``), as an NCDHW tensor. Differentiable (the halo gradients go back to their
    owners)."""
    d = layout.dim
    local = enter(x).movedim(d, -1)
    shape = local.shape
    if mode not in ("zeros", "constant"):
        # F.pad's reflect/replicate/circular pad the last dim only of a 3-D or 4-D tensor.
        local = local.flatten(1, 2)
    win = gather_window(local, wp, layout.sp_rank, layout.sp_group, mode, value)
    return win.reshape(*shape[:-1], win.shape[-1]).movedim(-1, d)


def saving_volume_window(
    win: Tensor,
    x: DTensor,
    layout: SpatialLayout,
    wp: WindowPlan,
    mode: str = "zeros",
    value: float = 0.0,
):
    """While active, an op that saves ``win`` (from ``gather_volume_window``, used as is) for
    its backward keeps the local block by reference plus the thin halo planes instead of the
    window copy, and rebuilds the window in the backward (as the strip ops do,
    ``_window.saving_window_by_reference``). A no-op context for the reflect, replicate and
    circular modes (their padding is not a constant) or a window padded further."""
    if mode not in ("zeros", "constant"):
        return contextlib.nullcontext()
    return saving_plain_window(win, enter(x), wp, layout.sp_rank, value, layout.dim)


def pad_local_dims(
    t: Tensor, pads: tuple[tuple[int, int], ...], sharded: int, mode: str, value: float = 0.0
) -> Tensor:
    """``F.pad`` the spatial dims of NCDHW ``t`` by ``pads`` ((lo, hi) for D, H, W) except
    the ``sharded`` tensor dim (already padded by ``gather_volume_window``). ``mode`` is a
    conv padding mode ("zeros" = constant ``value``). Padding is separable per dim, so padding
    the sharded dim first and the others afterwards equals padding all at once."""
    flat: list[int] = []
    for i in (4, 3, 2):  # F.pad lists the last dim first
        flat += [0, 0] if i == sharded else list(pads[i - 2])
    if not any(flat):
        return t
    if mode in ("zeros", "constant"):
        return F.pad(t, flat, mode="constant", value=value)
    return F.pad(t, flat, mode=mode)


def leave_window(out: Tensor, x: DTensor, layout: SpatialLayout, wp: WindowPlan) -> DTensor:
    """Wrap a window op's local output into a DTensor laid out like ``x``: global batch,
    the sharded dim's global output size ``wp.out_width``, the other dims as computed."""
    shape = [x.shape[0], *out.shape[1:]]
    shape[layout.dim] = wp.out_width
    return leave(out, layout, tuple(shape))
