"""Window ops (convolution, pooling) on width strips: plan the halo, fetch it, pad the edges.

``plan_window`` turns a layer's width geometry into an ``ExchangePlan`` plus, per rank, the
padding to add at the image edges and the columns to crop afterwards. ``gather_window``
runs it: after it, the unchanged local op runs with width padding 0 and produces exactly
this rank's output columns (DTensor chunking of the output width).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from ._geometry import (
    ExchangePlan,
    Interval,
    SpatialShardingError,
    all_shard_bounds,
    check_strips,
    window_input_range,
    window_out_size,
)
from ._halo import gather_columns

PAD_MODES = ("zeros", "constant", "reflect", "replicate", "circular")


@dataclass(frozen=True)
class WindowPlan:
    """Everything every rank needs to run one window op on its strip."""

    exchange: ExchangePlan
    out_width: int
    out_bounds: tuple[Interval, ...]
    #: per rank: (pad_left, pad_right, crop_left, crop_right) applied to the gathered columns
    edges: tuple[tuple[int, int, int, int], ...]


def _sources(lo: int, hi: int, width: int, mode: str) -> list[Interval]:
    """Global columns inside ``[0, width)`` needed to build window ``[lo, hi)`` in ``mode``."""
    if mode == "circular":
        if lo < -width or hi > 2 * width:
            raise SpatialShardingError("circular padding wider than the image")
        parts = []
        if lo < 0:
            parts.append((width + lo, width))
        if max(lo, 0) < min(hi, width):
            parts.append((max(lo, 0), min(hi, width)))
        if hi > width:
            parts.append((0, hi - width))
        return parts
    src_lo, src_hi = min(max(lo, 0), width), max(min(hi, width), min(max(lo, 0), width))
    if mode == "reflect":
        # Column -i mirrors column i (and W-1+i mirrors W-1-i): the edge rank needs them too.
        if lo < 0:
            src_lo, src_hi = 0, max(src_hi, 1 - lo)
        if hi > width:
            src_lo, src_hi = min(src_lo, 2 * width - 1 - hi), width
    elif mode == "replicate":
        if lo < 0:
            src_lo, src_hi = 0, max(src_hi, 1)
        if hi > width:
            src_lo, src_hi = min(src_lo, width - 1), width
    return [(src_lo, src_hi)] if src_lo < src_hi else []


@functools.lru_cache(maxsize=4096)
def plan_window(
    what: str,
    width: int,
    parts: int,
    kernel: int,
    stride: int,
    dilation: int,
    pad_lo: int,
    pad_hi: int,
    mode: str = "zeros",
    ceil_mode: bool = False,
) -> WindowPlan:
    """Plan a window op of the given width geometry over ``parts`` spatial ranks.

    Raises ``SpatialShardingError`` (naming ``what``) when a strip is empty or narrower than
    the halo it must give to its neighbour.
    """
    if mode not in PAD_MODES:
        raise SpatialShardingError(f"{what}: padding mode {mode!r} is not supported")
    owned = check_strips(what, width, parts, "input")
    out_width = window_out_size(width, kernel, stride, dilation, pad_lo, pad_hi, ceil_mode)
    if out_width < 1:
        raise SpatialShardingError(f"{what}: input width {width} is too small for this window")
    out_bounds = check_strips(what, out_width, parts, "output")
    needed, edges = [], []
    for o0, o1 in out_bounds:
        lo, hi = window_input_range(o0, o1, kernel, stride, dilation, pad_lo)
        if ceil_mode:
            hi = min(hi, width + pad_hi)  # ceil_mode windows may run past the padding: clip
        srcs = _sources(lo, hi, width, mode)
        needed.append(tuple(srcs))
        if mode == "circular":
            edges.append((0, 0, 0, 0))
            continue
        src_lo = srcs[0][0] if srcs else min(max(lo, 0), width)
        src_hi = srcs[-1][1] if srcs else src_lo
        pl, pr = max(0, src_lo - lo), max(0, hi - src_hi)
        edges.append((pl, pr, lo - min(lo, src_lo), max(hi, src_hi) - hi))
    plan = ExchangePlan(width, tuple(owned), tuple(needed), wrap=mode == "circular")
    plan.check_neighbours(what)
    return WindowPlan(plan, out_width, tuple(out_bounds), tuple(edges))


def gather_window(
    local: Tensor,
    wp: WindowPlan,
    rank: int,
    group,
    mode: str = "zeros",
    value: float = 0.0,
    pad_h: tuple[int, int] = (0, 0),
) -> Tensor:
    """Fetch this rank's window (halo included) and pad it at the image edges.

    ``mode`` "zeros"/"constant" pads with ``value`` (e.g. ``-inf`` for max pooling);
    "reflect"/"replicate"/"circular" follow ``F.pad``. ``pad_h`` pads the height the same way,
    so the local op afterwards runs with padding 0.
    """
    pl, pr, cl, cr = wp.edges[rank]
    if mode in ("zeros", "constant"):
        # The width padding is written straight into the window buffer (no extra copy).
        g = gather_columns(local, wp.exchange, rank, group, pl, pr, value)
        if any(pad_h):
            g = F.pad(g, (0, 0, *pad_h), mode="constant", value=value)
        return g.narrow(-1, cl, g.shape[-1] - cl - cr) if cl or cr else g
    g = gather_columns(local, wp.exchange, rank, group)
    if mode == "circular":
        if any(pad_h):
            g = F.pad(g, (0, 0, *pad_h), mode="circular")
    elif pl or pr or any(pad_h):
        g = F.pad(g, (pl, pr, *pad_h), mode=mode)
    if cl or cr:
        g = g.narrow(-1, cl, g.shape[-1] - cl - cr)
    return g


def shard_sizes(width: int, parts: int) -> list[int]:
    """Widths of every rank's strip under DTensor chunking."""
    return [b - a for a, b in all_shard_bounds(width, parts)]
