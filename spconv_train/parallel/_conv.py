"""Convolution and transposed convolution of any spatial rank on every layout, one
implementation each: the overlapped ``_halo_conv.py`` path where the last dim is sharded and
zero-padded, else the local convolution on ``tile_window``'s window; transposed convolution
from the input columns that reach each rank's outputs (docs/halo.md). The path chosen is the
same on every rank (message order).
"""

from __future__ import annotations

import contextlib
import functools

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._errors import module_label
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds, ntuple
from ._halo import sum_grad_over
from ._halo_conv import _CONV, halo_conv, plan_split
from ._mode import register_handler, register_spatial_module
from ._runtime import current_runtime
from ._sharding import enter, leave, run_unsharded, spatial_layout
from ._tiles import (
    along,
    layout_axes,
    sharded_axes,
    tile_shape,
    tile_window,
)
from ._window import WindowPlan, plan_window

#: ``(before, after)`` padding per spatial dim
Pads = tuple[tuple[int, int], ...]


def conv_pads(padding, kernel: tuple[int, ...], dilation) -> Pads:
    """``((before, after), ...)`` per spatial dim of a ``Conv*d`` / ``F.conv*d`` padding
    given as an int, a tuple, ``'valid'`` or ``'same'`` (the extra one of an even kernel goes
    after, as PyTorch does)."""
    n = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * n
        if padding != "same":
            raise ValueError(f"conv{n}d: padding {padding!r} is not 'same', 'valid' or a number")
        totals = [d * (k - 1) for d, k in zip(ntuple(dilation, n), kernel, strict=True)]
        return tuple((t // 2, t - t // 2) for t in totals)
    return tuple((p, p) for p in ntuple(padding, n))


def conv_padding(conv: nn.Module) -> Pads:
    """The padding a ``Conv*d`` applies *now*, per spatial dim, as torch reads it: zero
    padding from the live attributes (smp's ``make_dilated`` edits them after
    construction), the other modes from the constructor's ``_reversed_padding_repeated_twice``
    (torch pads with ``F.pad`` from that cache first)."""
    if conv.padding_mode != "zeros":
        rev = conv._reversed_padding_repeated_twice  # last dim first
        return tuple(zip(rev[::2], rev[1::2], strict=True))[::-1]
    return conv_pads(conv.padding, tuple(conv.kernel_size), conv.dilation)


def spatial_conv(
    x: DTensor,
    weight: Tensor,
    bias: Tensor | None,
    stride,
    padding: Pads,
    dilation,
    groups: int,
    padding_mode: str = "zeros",
    what: str = "conv",
) -> DTensor:
    """``F.conv{n}d`` of a DTensor on any layout; ``padding``: ``conv_pads``."""
    n = weight.ndim - 2
    stride, dilation = ntuple(stride, n), ntuple(dilation, n)
    x, layout = spatial_layout(x, what, ndim=n + 2, tiles=True)
    shape = tuple(x.shape)
    axes = {d: (parts, rank, group) for d, parts, rank, group in sharded_axes(layout)}
    whole = [d for d in range(2, x.ndim) if d not in axes]  # padded inside the conv
    inside = padding_mode == "zeros" and all(padding[d - 2][0] == padding[d - 2][1] for d in whole)
    if all(parts == 1 for parts, _, _ in axes.values()):  # whole extents: the plain op
        symmetric = padding_mode == "zeros" and all(a == b for a, b in padding)
        flat = [] if symmetric else [a for pair in padding[::-1] for a in pair]  # last dim first
        inner = tuple(a for a, _ in padding) if symmetric else 0
        mode = "constant" if padding_mode == "zeros" else padding_mode

        def plain(t: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            t = F.pad(t, flat, mode=mode) if any(flat) else t
            return _CONV[n](t, w, b, stride, inner, dilation, groups)

        return run_unsharded(x, layout, plain, weight, bias)
    geoms = {
        d: (weight.shape[d], stride[d - 2], dilation[d - 2], *padding[d - 2])
        for d in range(2, x.ndim)
    }
    local = enter(x)
    w, b = sum_grad_over(weight, layout.grad_groups), sum_grad_over(bias, layout.grad_groups)
    last, split = x.ndim - 1, None
    if inside and axes.get(last, (1,))[0] > 1 and current_runtime().options.split_halo_conv:
        parts, rank, group = axes[last]
        wp = plan_window(what, shape[last], parts, *geoms[last], padding_mode)
        split = plan_split(wp, rank, *geoms[last][:4])
    if split is not None:  # the other sharded dims' window, the last dim in halo_conv
        geoms = {d: geoms[d] for d in axes if d != last}
    tw = tile_window(local, shape, layout, what, geoms, padding_mode, pad_local=not inside)
    conv_pad = tuple(padding[d - 2][0] if inside and d not in axes else 0 for d in range(2, x.ndim))
    # Zero padding: the window is saved as the part by reference + thin halos (memory ~1/N).
    with tw.saving():
        if split is None:
            out = _CONV[n](tw.window, w, b, stride, conv_pad, dilation, groups)
            return leave(out, layout, tile_shape(shape, out, tw))
        args = (wp, split, rank, group, stride, conv_pad[:-1], dilation, groups)
        out = halo_conv(tw.window, w, b, *args)
    return leave(out, layout, (*tile_shape(shape, out, tw)[:last], wp.out_width))


class _SpatialConv:
    """``Conv*d`` running ``spatial_conv`` on a DTensor input (any layout)."""

    spatial_name: str = ""

    def forward(self, input: Tensor) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input)
        args = (self.stride, conv_padding(self), self.dilation, self.groups, self.padding_mode)
        return spatial_conv(input, self.weight, self.bias, *args, what=module_label(self))


def spatial_subclasses(mixin: type, *bases: type, module: str) -> list[type]:
    """``Spatial<base>(mixin, base)`` per base, registered for ``parallelize`` to swap in place."""
    made = []
    for base in bases:
        name = f"Spatial{base.__name__}"
        attrs = {"__doc__": mixin.__doc__, "__module__": module, "__qualname__": name}
        made.append(register_spatial_module(base)(type(name, (mixin, base), attrs)))
    return made


SpatialConv1d, SpatialConv2d, SpatialConv3d = spatial_subclasses(
    _SpatialConv, nn.Conv1d, nn.Conv2d, nn.Conv3d, module=__name__
)


@register_handler(F.conv1d, F.conv2d, F.conv3d)  # torch.conv*d are the same objects
def _functional_conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    pads = conv_pads(padding, tuple(weight.shape[2:]), dilation)
    what = f"F.conv{weight.ndim - 2}d"
    return spatial_conv(input, weight, bias, stride, pads, dilation, groups, what=what)


#: the local op per spatial rank
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@functools.lru_cache(maxsize=1024)
def plan_conv_transpose(
    what: str,
    width: int,
    parts: int,
    kernel: int,
    stride: int,
    dilation: int,
    padding: int,
    output_padding: int,
) -> WindowPlan:
    """Plan a transposed convolution of the given width geometry over ``parts`` ranks: each
    rank's window is the input columns that reach its outputs, never padded."""
    if not (output_padding < stride or output_padding < dilation):
        raise SpatialShardingError(
            f"{what}: width output_padding {output_padding} must be smaller than the stride "
            f"({stride}) or the dilation ({dilation}); torch rejects this layer too."
        )
    out_width = (width - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    if out_width < 1:
        raise SpatialShardingError(
            f"{what}: input width {width} gives output width {out_width}; torch rejects it too."
        )
    out_bounds = tuple(all_shard_bounds(out_width, parts))
    starts, needed = [], []
    for o0, o1 in out_bounds:  # input i adds into outputs i*s - p + t*d, t < k
        lo = max(0, -(-(o0 + padding - dilation * (kernel - 1)) // stride))
        hi = min(width, (o1 - 1 + padding) // stride + 1)
        starts.append(min(lo, width))
        needed.append(((lo, hi),) if o0 < o1 and lo < hi else ())
    plan = ExchangePlan(width, tuple(all_shard_bounds(width, parts)), tuple(needed))
    plan.check_neighbours(what)
    return WindowPlan(plan, out_width, out_bounds, ((0, 0, 0, 0),) * parts, tuple(starts))


def _place(y: Tensor, start: int, o0: int, o1: int) -> Tensor:
    """``y`` (first column: global ``start``) cropped or zero-padded to global ``[o0, o1)``
    by one ``F.pad``, which keeps ``y``'s memory layout in forward and backward (a cropping
    ``narrow``'s backward would allocate the gradient NCHW)."""
    a, b = max(start, o0), min(start + y.shape[-1], o1)
    if b <= a:  # nothing of y lands in [o0, o1): all zeros (y stays in the graph)
        return F.pad(y.narrow(-1, 0, 0), (o1 - o0, 0))
    lo, hi = start - o0, o1 - start - y.shape[-1]
    return F.pad(y, (lo, hi)) if lo or hi else y


@register_handler(F.conv_transpose2d, F.conv_transpose3d)  # torch.conv_transpose*d: the same
def spatial_conv_transpose(
    input: DTensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride=1,
    padding=0,
    output_padding=0,
    groups: int = 1,
    dilation=1,
    what: str | None = None,
) -> DTensor:
    """``F.conv_transpose{n}d`` of a DTensor on any layout (module docstring); torch's
    argument names (``input=`` too: it is the handler of the functional)."""
    n = weight.ndim - 2
    what = what or f"F.conv_transpose{n}d"
    s, p, op, dil = (ntuple(v, n) for v in (stride, padding, output_padding, dilation))
    x, layout = spatial_layout(input, what, ndim=n + 2, tiles=True)
    conv = _CONV_T[n]
    axes = layout_axes(layout)
    if not axes:  # spatially replicated (e.g. a pooled map): the plain op
        return run_unsharded(
            x, layout, lambda t, w, b: conv(t, w, b, s, p, op, groups, dil), weight, bias
        )
    geoms = {d: (weight.shape[d], s[d - 2], dil[d - 2], p[d - 2], op[d - 2]) for d, _ in axes}
    tw = tile_window(enter(x), tuple(x.shape), layout, what, geoms, plan=plan_conv_transpose)
    # No input reaches this rank's outputs along a dim: one zero row keeps the weight and the
    # exchange in its graph (every rank must run their backward collectives).
    grow = [a for d in range(x.ndim - 1, 1, -1) for a in (0, int(tw.window.shape[d] == 0))]
    t = F.pad(tw.window, grow) if any(grow) else tw.window
    pads, out_pads = (tuple(0 if j + 2 in geoms else v[j] for j in range(n)) for v in (p, op))
    w = sum_grad_over(weight, layout.grad_groups)
    with tw.saving() if t is tw.window else contextlib.nullcontext():  # by reference + halos
        y = conv(t, w, None, s, pads, out_pads, groups, dil)
    for d, (o0, o1) in tw.out_ranges.items():  # along the sharded dims: the global width
        a = tw.starts[d] * s[d - 2] - p[d - 2]
        y = along(y, d, lambda m, a=a, o0=o0, o1=o1: _place(m, a, o0, o1))
    if bias is not None:
        y = y + sum_grad_over(bias, layout.grad_groups).view(1, -1, *([1] * n))
    return leave(y, layout, tile_shape(tuple(x.shape), y, tw))


class _SpatialConvTranspose:
    """``ConvTranspose{n}d`` running ``spatial_conv_transpose`` on a DTensor input."""

    spatial_name: str = ""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input, output_size)
        n = len(self.kernel_size)
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for ConvTranspose{n}d")
        op = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, n, self.dilation
        )
        args = (self.stride, self.padding, tuple(op), self.groups, self.dilation)
        return spatial_conv_transpose(input, self.weight, self.bias, *args, what=module_label(self))


SpatialConvTranspose2d, SpatialConvTranspose3d = spatial_subclasses(
    _SpatialConvTranspose, nn.ConvTranspose2d, nn.ConvTranspose3d, module=__name__
)
