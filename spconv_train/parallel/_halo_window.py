"""``halo_window``: one call that gives a window op its input on any layout.

A window op (a convolution, a pooling, a median filter...) computes output position ``j`` of
every spatial dim from inputs ``j * stride - pad_lo + t * dilation``, ``t < kernel``. On a
sharded tensor each rank needs its own part plus a halo from its neighbours, and the image
edges padded in the op's padding mode. ``halo_window`` fetches exactly that for every layout
``spatial_layout`` reads: width strips, H x W tiles, volumes split along one of D, H, W or
into 2-D / 3-D blocks, or a tensor whose spatial dims are all replicated (after a global
pooling). Every layout goes through the same exchange (``_tiles.tile_window``): one 1-D halo
exchange per sharded dim, each on the window of the previous one, so corners arrive from the
diagonal neighbours in neighbour-only messages. A plain tensor is simply padded.

The unchanged local op then runs on ``HaloWindow.local`` with padding 0 and produces exactly
this rank's output positions (DTensor's chunking of the output), and ``HaloWindow.wrap``
turns that local result into the output DTensor. Both directions are differentiable: the
halo's backward sends the gradients of borrowed positions back to their owners.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._geometry import SpatialShardingError, window_out_size
from ._sharding import SpatialLayout, enter, leave, spatial_layout
from ._tiles import TileWindow, saving_tile_window, tile_shape, tile_window
from ._window import PAD_MODES

IntOrSeq = int | Sequence[int]


def _per_dim(value, n: int, name: str, what: str) -> list:
    """``value`` repeated for ``n`` spatial dims, or checked to hold one entry per dim."""
    if isinstance(value, int):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise SpatialShardingError(
            f"{what}: {name}={value!r} needs one entry per spatial dim ({n}) or a single int"
        )
    return values


def _geoms(ndim: int, kernel, stride, padding, dilation, what: str) -> dict[int, tuple]:
    """``{tensor dim: (kernel, stride, dilation, pad_lo, pad_hi)}`` of every spatial dim."""
    n = ndim - 2
    ks = _per_dim(kernel, n, "kernel", what)
    ss = _per_dim(stride, n, "stride", what)
    ds = _per_dim(dilation, n, "dilation", what)
    ps = _per_dim(padding, n, "padding", what)
    pads = [(p, p) if isinstance(p, int) else tuple(p) for p in ps]
    if any(len(p) != 2 or min(p) < 0 for p in pads) or min(ks + ss + ds) < 1:
        raise SpatialShardingError(
            f"{what}: kernel, stride, dilation must be >= 1 and padding >= 0 (an int or a "
            f"(before, after) pair per dim), got kernel={kernel}, stride={stride}, "
            f"dilation={dilation}, padding={padding}"
        )
    return {2 + i: (ks[i], ss[i], ds[i], *pads[i]) for i in range(n)}


@dataclass(frozen=True)
class HaloWindow:
    """This rank's input window for a window op, and the way back to the output DTensor."""

    #: the window (local part + halos + edge padding): run the op on it with padding 0
    local: Tensor
    #: the input's layout (``None`` for a plain tensor)
    layout: SpatialLayout | None
    #: the global input shape
    input_shape: tuple[int, ...]
    #: ``{spatial tensor dim: (start, stop)}``: the global output positions this rank computes
    out_ranges: dict[int, tuple[int, int]]
    #: ``{spatial tensor dim: size}``: the global output size
    out_sizes: dict[int, int]
    what: str = "halo_window"
    _tile: TileWindow | None = dataclasses.field(default=None, repr=False)
    _source: Tensor | None = dataclasses.field(default=None, repr=False)
    _value: float = 0.0

    @property
    def grad_groups(self) -> tuple:
        """Groups over which a parameter gradient computed on this window is a partial sum
        (give them to ``sum_grad_over``); empty for a plain tensor."""
        return self.layout.grad_groups if self.layout is not None else ()

    def wrap(self, out: Tensor) -> Tensor:
        """The op's local result on ``local`` as the output DTensor (laid out like the
        input; its spatial dims have the global output sizes, its other dims are what
        ``out`` has). A plain tensor is returned as it is."""
        for d, (lo, hi) in self.out_ranges.items():
            if out.ndim != len(self.input_shape) or out.shape[d] != hi - lo:
                raise SpatialShardingError(
                    f"{self.what}: the local result has shape {tuple(out.shape)}; dim {d} must "
                    f"hold this rank's {hi - lo} output positions (run the op on "
                    f"HaloWindow.local with padding 0 and the same kernel, stride, dilation)"
                )
        if self.layout is None:
            return out
        shape = tile_shape(self.input_shape, out, self._tile)
        return leave(out, self.layout, shape)

    def saving(self):
        """Context: an op run inside it that saves ``local`` for its backward keeps the local
        part by reference plus the thin halos instead of the window copy (activation memory
        of a sharded conv: one device's / N). A no-op for padded-locally or cropped windows
        and plain tensors."""
        if self._tile is None or self._source is None:
            return contextlib.nullcontext()
        return saving_tile_window(self._tile, self._source, self._value)


def _strip_axes(layout: SpatialLayout) -> SpatialLayout:
    """``layout`` with its one sharded dim as an axis (the tile exchange handles any set)."""
    if layout.axes or not layout.width_sharded:
        return layout
    return dataclasses.replace(layout, axes=((layout.dim, layout.sp_dim),))


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
    """This rank's input window for a window op of the given geometry on ``x`` (an NCHW
    image or NCDHW volume, sharded in any layout, replicated, or a plain tensor).

    ``kernel``, ``stride``, ``dilation``: an int or one per spatial dim; ``padding``: an int,
    or per spatial dim an int or a ``(before, after)`` pair. ``padding_mode`` is one of
    ``"zeros"``, ``"constant"`` (with ``value``; e.g. ``-inf`` for a max), ``"reflect"``,
    ``"replicate"``, ``"circular"`` (as ``F.pad``). Raises ``SpatialShardingError`` naming
    ``what`` when a rank's part is narrower than the halo it must lend, or would have no
    output. Differentiable."""
    if padding_mode not in PAD_MODES:
        raise SpatialShardingError(
            f"{what}: padding_mode {padding_mode!r} is not one of {list(PAD_MODES)}"
        )
    geoms = _geoms(x.ndim, kernel, stride, padding, dilation, what)
    if not isinstance(x, DTensor):
        return _plain_window(x, geoms, padding_mode, value, what)
    x, layout = spatial_layout(x, what, ndim=x.ndim, tiles=True)
    local = enter(x)
    tw = tile_window(local, tuple(x.shape), _strip_axes(layout), what, geoms, padding_mode, value)
    return HaloWindow(
        tw.window, layout, tuple(x.shape), tw.out_ranges, tw.out_sizes, what, tw, local, value
    )


def _plain_window(x: Tensor, geoms: dict, mode: str, value: float, what: str) -> HaloWindow:
    shape = tuple(x.shape)
    pads: list[int] = []
    for d in sorted(geoms, reverse=True):  # F.pad lists the last dim first
        pads += list(geoms[d][3:5])
    if any(pads):
        x = (
            F.pad(x, pads, mode="constant", value=value)
            if mode in ("zeros", "constant")
            else F.pad(x, pads, mode=mode)
        )
    sizes = {
        d: window_out_size(shape[d], k, s, dil, lo, hi) for d, (k, s, dil, lo, hi) in geoms.items()
    }
    ranges = {d: (0, n) for d, n in sizes.items()}
    return HaloWindow(x, None, shape, ranges, sizes, what)
