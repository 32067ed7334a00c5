"""Transposed convolution (``ConvTranspose2d`` / ``ConvTranspose3d``) on every layout: width
strips, H x W tiles, volume blocks, any spatial rank; one implementation over the layout's
sharded axes (``_tiles.layout_axes``).

Along a sharded dim, input column ``i`` of a transposed convolution adds into output columns
``i*s - p + t*d`` (``t = 0..k-1``), and the output width is
``(W-1)*s - 2p + d*(k-1) + output_padding + 1``. Rank ``r`` owns output columns ``[o0, o1)``
(DTensor chunking of that width), so it needs input columns
``[ceil((o0 + p - d*(k-1)) / s), floor((o1 - 1 + p) / s)]`` clipped to ``[0, W)``. It fetches
them, runs the unchanged local ``F.conv_transpose2d`` with width padding 0 and no bias (its
output starts at global column ``i_lo*s - p``), crops or zero-pads that to exactly
``[o0, o1)`` (columns no input reaches, e.g. the ``output_padding`` band, are zero in torch
too) and adds the bias last, so the padded columns hold the bias exactly as torch's do.
Every other sharded dim is done the same way in turn (W, then H on the W window, then D, so
the corner inputs arrive with the second exchange); the dims no mesh dim shards run the
ordinary way (stride, padding, output_padding, dilation unchanged).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._geometry import ExchangePlan, Interval, SpatialShardingError, all_shard_bounds, ntuple
from ._halo import gather_columns, sum_grad_over
from ._label import module_label
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._sharding import enter, leave, run_unsharded, spatial_layout
from ._tiles import along, axis_of, layout_axes
from ._window import WindowStep, saving_steps_by_reference

#: the local op per spatial rank
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class TransposePlan:
    """Everything every rank needs to run one transposed convolution on its strip."""

    exchange: ExchangePlan
    out_width: int
    out_bounds: tuple[Interval, ...]
    #: per rank: the input columns ``[lo, hi)`` it convolves (``hi <= lo``: none reach it)
    windows: tuple[Interval, ...]


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
) -> TransposePlan:
    """Plan a transposed convolution of the given width geometry over ``parts`` ranks.

    Raises ``SpatialShardingError`` (naming ``what``) for a geometry torch rejects too, or
    when a rank would need columns from a rank that is not its neighbour.
    """
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
    windows, needed = [], []
    for o0, o1 in out_bounds:  # input i adds into outputs i*s - p + t*d, t < k
        lo = max(0, -(-(o0 + padding - dilation * (kernel - 1)) // stride))
        hi = min(width, (o1 - 1 + padding) // stride + 1)
        if o1 <= o0 or hi <= lo:
            lo, hi = min(lo, width), min(lo, width)
        windows.append((lo, hi))
        needed.append(((lo, hi),) if lo < hi else ())
    plan = ExchangePlan(width, tuple(all_shard_bounds(width, parts)), tuple(needed))
    plan.check_neighbours(what)
    return TransposePlan(plan, out_width, out_bounds, tuple(windows))


def _place(y: Tensor, start: int, o0: int, o1: int) -> Tensor:
    """Crop or zero-pad ``y`` (whose first column is global column ``start``) to exactly the
    global columns ``[o0, o1)``."""
    a, b = max(start, o0), min(start + y.shape[-1], o1)
    if b <= a:  # nothing of y lands in [o0, o1): all zeros (y stays in the graph)
        return F.pad(y.narrow(-1, 0, 0), (o1 - o0, 0))
    y = y.narrow(-1, a - start, b - a)
    return F.pad(y, (a - o0, o1 - b)) if a > o0 or o1 > b else y


def spatial_conv_transpose(
    x: DTensor,
    weight: Tensor,
    bias: Tensor | None,
    stride,
    padding,
    output_padding,
    groups: int,
    dilation,
    what: str = "conv_transpose",
) -> DTensor:
    """Transposed convolution of a sharded DTensor of any spatial rank (the weight's) on any
    layout; same result as ``F.conv_transpose{n}d`` on the whole tensor. Per sharded dim
    (W, then H on the W window, then D): fetch the input rows or columns that reach this
    rank's outputs; then convolve with padding 0 along those dims and no bias, place the
    result on the rank's output range per sharded dim, add the bias last. Weight and bias
    gradients are summed over the ranks holding other parts (and other batch parts)."""
    n = weight.ndim - 2
    s, p, op, dil = (ntuple(v, n) for v in (stride, padding, output_padding, dilation))
    x, layout = spatial_layout(x, what, ndim=n + 2, tiles=True)
    conv = _CONV_T[n]
    if not layout_axes(layout):  # spatially replicated (e.g. a pooled map): the plain op
        return run_unsharded(
            x, layout, lambda t, w, b: conv(t, w, b, s, p, op, groups, dil), weight, bias
        )
    t = local = enter(x)
    pads, out_pads, shape = list(p), list(op), list(x.shape)
    placed, steps, fetched = [], [], True
    for d in range(x.ndim - 1, 1, -1):
        ax = axis_of(layout, d)
        if ax is None:
            continue
        j, (parts, rank, group) = d - 2, ax
        tp = plan_conv_transpose(
            what, x.shape[d], parts, weight.shape[d], s[j], dil[j], p[j], op[j]
        )
        lo, hi = tp.windows[rank]
        if parts == 1 and not tp.exchange.needed[0]:
            t, fetched = t.narrow(d, 0, 0), False
        else:  # every rank takes part: others may need its rows even if it needs none
            t = along(t, d, lambda m, e=tp.exchange, r=rank, g=group: gather_columns(m, e, r, g))
            steps.append(WindowStep(d, tp.exchange, rank, 0, 0, t))
        if hi <= lo:
            # No input reaches this rank's outputs: convolve one zero row instead, so the
            # weight and the exchange stay in this rank's graph and their backward
            # collectives run on every rank (a rank skipping them would hang the others).
            t, fetched = along(t, d, lambda m: F.pad(m, (0, 1))), False
        pads[j], out_pads[j], shape[d] = 0, 0, tp.out_width
        placed.append((d, lo * s[j] - p[j], *tp.out_bounds[rank]))
    w = sum_grad_over(weight, layout.grad_groups)
    # Save the local part by reference + the thin halo slabs, not the window copy (~1/N).
    saving = contextlib.nullcontext()
    if fetched and steps and torch.is_grad_enabled():
        saving = saving_steps_by_reference(t, local, tuple(steps))
    with saving:
        y = conv(t, w, None, s, tuple(pads), tuple(out_pads), groups, dil)
    for d, start, o0, o1 in placed:
        y = along(y, d, lambda m, a=start, o0=o0, o1=o1: _place(m, a, o0, o1))
    if bias is not None:
        y = y + sum_grad_over(bias, layout.grad_groups).view(1, -1, *([1] * n))
    shape[1] = y.shape[1]
    for d in range(2, x.ndim):
        if axis_of(layout, d) is None:
            shape[d] = y.shape[d]
    return leave(y, layout, tuple(shape))


class _SpatialConvTranspose:
    """Forward of the spatial ``ConvTranspose{n}d`` modules on a sharded DTensor:
    ``output_padding`` from the global shape (as torch does, so ``output_size`` works), then
    ``spatial_conv_transpose``. A plain tensor input runs the ordinary layer."""

    spatial_name: str = ""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input, output_size)
        n = len(self.kernel_size)
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for ConvTranspose{n}d")
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, n, self.dilation
        )
        args = (self.stride, self.padding, tuple(output_padding), self.groups, self.dilation)
        what = module_label(self)
        return spatial_conv_transpose(input, self.weight, self.bias, *args, what=what)


@register_spatial_module(nn.ConvTranspose2d)
class SpatialConvTranspose2d(_SpatialConvTranspose, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on a sharded NCHW input (strips or tiles); ``parallelize``
    turns a model's ``ConvTranspose2d`` modules into this class in place."""


@register_spatial_module(nn.ConvTranspose3d)
class SpatialConvTranspose3d(_SpatialConvTranspose, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on a volume sharded along one, two or three of D, H, W."""


@register_handler(F.conv_transpose2d, F.conv_transpose3d)  # torch.conv_transpose*d: the same
def _functional_conv_transpose(
    input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1
):
    """``F.conv_transpose2d`` / ``F.conv_transpose3d`` called from model code on a sharded
    input."""
    args = (stride, padding, output_padding, groups, dilation)
    what = f"F.conv_transpose{weight.ndim - 2}d"
    return spatial_conv_transpose(input, weight, bias, *args, what=what)
