"""Convolution (``Conv1d/2d/3d``, ``F.conv1d/2d/3d``) on every layout: one implementation.

A layout is its list of sharded axes (``_tiles.layout_axes``): none (replicated), one
(strips, a volume sharded along D, H or W, a 1-D signal), two or three (tiles, volume
blocks). Every ``nn.Conv*d`` configuration is covered: any kernel (even ones too), stride,
dilation, groups, padding given as int, tuple, ``'same'`` or ``'valid'``, and the padding
modes zeros/reflect/replicate/circular. The output is laid out like the input, each rank
holding DTensor's chunk of the output along every sharded dim.

Two paths, chosen identically on every rank (they order their messages differently):

- the fast path (``_halo_conv.py``), for zero padding when the last tensor dim is sharded:
  the other sharded dims are windowed first (``tile_window``; the corners then come with the
  exchange along the last dim), and the convolution along the last dim runs on the part
  itself with the halo exchange overlapped, no padded copy;
- the window path: ``tile_window`` fetches the halo of every sharded dim in turn (W, then H
  on the W window, then D: corners included) with the image edges padded in the layer's
  mode, and the unchanged local convolution runs on that window with padding 0 there.

Symmetric zero padding of the dims no mesh dim shards is done inside the convolution
itself, as ``nn.Conv2d`` does. Weight and bias gradients are summed over the ranks holding
other parts (and other batch parts).
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._geometry import ntuple
from ._halo import sum_grad_over
from ._halo_conv import _CONV, halo_conv, plan_split
from ._label import module_label
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._runtime import current_runtime
from ._sharding import enter, leave, run_unsharded, spatial_layout
from ._tiles import saving_tile_window, sharded_axes, tile_shape, tile_window
from ._window import plan_window

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
    """The padding a ``Conv*d`` applies *now*, per spatial dim.

    Read from the live ``padding``/``dilation``/``kernel_size`` attributes, as
    ``_conv_forward`` does for zero padding: code that edits a layer after construction
    (smp's ``make_dilated``) changes them, while the cached ``_reversed_padding_repeated_twice``
    keeps the constructor's values. The other padding modes *do* use that cache in torch (it
    pads with ``F.pad`` first), so they read it too: the sharded layer computes exactly what
    the single-device layer computes."""
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
    """Convolution of a DTensor of any spatial rank (the weight's) on any layout; same
    result as ``F.conv{n}d`` on the whole tensor. ``padding`` is ``(before, after)`` per
    spatial dim (``conv_pads``)."""
    n = weight.ndim - 2
    stride, dilation = ntuple(stride, n), ntuple(dilation, n)
    x, layout = spatial_layout(x, what, ndim=n + 2, tiles=True)
    shape = tuple(x.shape)
    axes = {d: (parts, rank, group) for d, parts, rank, group in sharded_axes(layout)}
    zeros = padding_mode == "zeros"
    # Symmetric zero padding of the dims no mesh dim shards is cheapest inside the conv.
    whole = [d for d in range(2, x.ndim) if d not in axes]
    inside = zeros and all(padding[d - 2][0] == padding[d - 2][1] for d in whole)
    if all(parts == 1 for parts, _, _ in axes.values()):
        # Whole extents on every rank (replicated, or one part per axis): the plain op.
        plain = _plain(stride, padding, dilation, groups, padding_mode)
        return run_unsharded(x, layout, plain, weight, bias)
    geoms = {
        d: (weight.shape[d], stride[d - 2], dilation[d - 2], *padding[d - 2])
        for d in range(2, x.ndim)
    }
    local = enter(x)
    w, b = sum_grad_over(weight, layout.grad_groups), sum_grad_over(bias, layout.grad_groups)
    last = x.ndim - 1
    if inside and axes.get(last, (1,))[0] > 1 and current_runtime().options.split_halo_conv:
        parts, rank, group = axes[last]
        k, s, dil, lo, hi = geoms[last]
        wp = plan_window(what, shape[last], parts, k, s, dil, lo, hi, padding_mode)
        split = plan_split(wp, rank, k, s, dil, lo)
        if split is not None:
            others = {d: geoms[d] for d in axes if d != last}
            tw = tile_window(local, shape, layout, what, others, pad_local=False)
            pad_other = tuple(0 if d in axes else padding[d - 2][0] for d in range(2, last))
            # The other dims' window is saved as the part by reference + thin halo slabs.
            saving = saving_tile_window(tw, local) if others else contextlib.nullcontext()
            with saving:
                args = (wp, split, rank, group, stride, pad_other, dilation, groups)
                out = halo_conv(tw.window, w, b, *args)
            out_shape = list(tile_shape(shape, out, tw))
            out_shape[last] = wp.out_width
            return leave(out, layout, tuple(out_shape))
    tw = tile_window(local, shape, layout, what, geoms, padding_mode, pad_local=not inside)
    conv_pad = tuple(padding[d - 2][0] if inside and d not in axes else 0 for d in geoms)
    # Zero padding: the window is saved as the part by reference + thin halos (memory ~1/N).
    with saving_tile_window(tw, local):
        out = _CONV[n](tw.window, w, b, stride, conv_pad, dilation, groups)
    return leave(out, layout, tile_shape(shape, out, tw))


def _plain(stride, padding: Pads, dilation, groups: int, padding_mode: str):
    """The single-device convolution of the given geometry, as a function of
    ``(input, weight, bias)``: padding inside the convolution when torch's layer does it."""
    flat = [a for pair in padding[::-1] for a in pair]  # F.pad lists the last dim first
    mode = "constant" if padding_mode == "zeros" else padding_mode
    symmetric = padding_mode == "zeros" and all(a == b for a, b in padding)
    conv = _CONV[len(padding)]

    def run(t: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if symmetric:
            return conv(t, w, b, stride, tuple(a for a, _ in padding), dilation, groups)
        t = F.pad(t, flat, mode=mode) if any(flat) else t
        return conv(t, w, b, stride, 0, dilation, groups)

    return run


class _SpatialConv:
    """Forward of the spatial ``Conv*d`` modules: a sharded DTensor input runs
    ``spatial_conv``, a plain tensor the ordinary layer."""

    spatial_name: str = ""

    def forward(self, input: Tensor) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input)
        args = (self.stride, conv_padding(self), self.dilation, self.groups, self.padding_mode)
        return spatial_conv(input, self.weight, self.bias, *args, what=module_label(self))


@register_spatial_module(nn.Conv1d)
class SpatialConv1d(_SpatialConv, nn.Conv1d):
    """``nn.Conv1d`` on an NCL signal sharded along its length (or replicated)."""


@register_spatial_module(nn.Conv2d)
class SpatialConv2d(_SpatialConv, nn.Conv2d):
    """``nn.Conv2d`` on a sharded NCHW input (strips or tiles). ``parallelize`` turns a
    model's ``Conv2d`` modules into this class in place, so parameters, hooks and
    ``state_dict`` keys stay exactly those of the original."""


@register_spatial_module(nn.Conv3d)
class SpatialConv3d(_SpatialConv, nn.Conv3d):
    """``nn.Conv3d`` on a volume sharded along one, two or three of D, H, W."""


@register_handler(F.conv1d, F.conv2d, F.conv3d)  # torch.conv*d are the same objects
def _functional_conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``F.conv1d/2d/3d`` called from model code on a sharded input."""
    n = weight.ndim - 2
    pads = conv_pads(padding, tuple(weight.shape[2:]), dilation)
    args = (stride, pads, dilation, groups)
    return spatial_conv(input, weight, bias, *args, what=f"F.conv{n}d")
