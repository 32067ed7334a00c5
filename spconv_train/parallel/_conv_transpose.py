"""Width-sharded ``ConvTranspose2d``: fetch the input columns that reach this rank's output.

Along the width, input column ``i`` of a transposed convolution adds into output columns
``i*s - p + t*d`` (``t = 0..k-1``), and the output width is
``(W-1)*s - 2p + d*(k-1) + output_padding + 1``. Rank ``r`` owns output columns ``[o0, o1)``
(DTensor chunking of that width), so it needs input columns
``[ceil((o0 + p - d*(k-1)) / s), floor((o1 - 1 + p) / s)]`` clipped to ``[0, W)``. It fetches
them, runs the unchanged local ``F.conv_transpose2d`` with width padding 0 and no bias (its
output starts at global column ``i_lo*s - p``), crops or zero-pads that to exactly
``[o0, o1)`` (columns no input reaches, e.g. the ``output_padding`` band, are zero in torch
too) and adds the bias last, so the padded columns hold the bias exactly as torch's do.
The height runs the ordinary way (stride, padding, output_padding, dilation unchanged).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._geometry import ExchangePlan, Interval, SpatialShardingError, all_shard_bounds
from ._halo import gather_columns, sum_grad_over
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._sharding import enter, leave, run_unsharded, spatial_layout
from ._window import saving_window_by_reference


def conv_transpose_out_size(
    size: int, kernel: int, stride: int, dilation: int, padding: int, output_padding: int
) -> int:
    """Output length of a transposed convolution along one dimension."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def conv_transpose_input_range(
    out_start: int, out_stop: int, size: int, kernel: int, stride: int, dilation: int, pad: int
) -> Interval:
    """Input columns ``[lo, hi)`` (inside ``[0, size)``, possibly empty: ``hi <= lo``) that
    contribute to the transposed convolution's outputs ``[out_start, out_stop)``."""
    lo = max(0, -(-(out_start + pad - dilation * (kernel - 1)) // stride))
    hi = min(size, (out_stop - 1 + pad) // stride + 1)
    return lo, hi


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
    out_width = conv_transpose_out_size(width, kernel, stride, dilation, padding, output_padding)
    if out_width < 1:
        raise SpatialShardingError(
            f"{what}: input width {width} gives output width {out_width}; torch rejects it too."
        )
    out_bounds = tuple(all_shard_bounds(out_width, parts))
    windows, needed = [], []
    for o0, o1 in out_bounds:
        lo, hi = conv_transpose_input_range(o0, o1, width, kernel, stride, dilation, padding)
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


def spatial_conv_transpose2d(
    x: DTensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    output_padding: tuple[int, int],
    groups: int,
    dilation: tuple[int, int],
    what: str = "conv_transpose2d",
) -> DTensor:
    """2-D transposed convolution of a width-sharded DTensor ``x``; same result as
    ``F.conv_transpose2d`` on the whole tensor. Weight and bias gradients are summed over the
    ranks holding other strips (and other batch parts)."""
    x, layout = spatial_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_conv_transpose  # imports this module

        args = (weight, bias, stride, padding, output_padding, groups, dilation, what)
        return tile_conv_transpose(x, layout, *args)
    if not layout.width_sharded:
        return run_unsharded(
            x,
            layout,
            lambda t, w, b: F.conv_transpose2d(
                t, w, b, stride, padding, output_padding, groups, dilation
            ),
            weight,
            bias,
        )
    kw = weight.shape[-1]
    tp = plan_conv_transpose(
        what,
        x.shape[layout.dim],
        layout.sp_size,
        kw,
        stride[1],
        dilation[1],
        padding[1],
        output_padding[1],
    )
    rank = layout.sp_rank
    local = enter(x)
    if layout.sp_size == 1 and not tp.exchange.needed[0]:
        window = local.narrow(-1, 0, 0)
    else:  # every rank takes part: others may need its columns even if it needs none
        window = gather_columns(local, tp.exchange, rank, layout.sp_group)
    lo, hi = tp.windows[rank]
    if hi <= lo:
        # No input column reaches this rank's outputs: convolve one zero column instead, so
        # the weight and the exchange stay in this rank's graph and their backward
        # collectives run on every rank (a rank skipping them would hang the others).
        window = F.pad(window, (0, 1))
    groups_ = layout.grad_groups
    # Save the strip by reference + thin halos rather than a copy of it (memory ~1/N).
    by_ref = hi > lo and layout.sp_size > 1 and torch.is_grad_enabled()
    with (
        saving_window_by_reference(window, local, tp.exchange, rank)
        if by_ref
        else contextlib.nullcontext()
    ):
        y = F.conv_transpose2d(
            window,
            sum_grad_over(weight, groups_),
            None,
            stride,
            (padding[0], 0),
            (output_padding[0], 0),
            groups,
            dilation,
        )
    o0, o1 = tp.out_bounds[rank]
    y = _place(y, lo * stride[1] - padding[1], o0, o1)
    if bias is not None:
        y = y + sum_grad_over(bias, groups_).view(1, -1, 1, 1)
    return leave(y, layout, (x.shape[0], y.shape[1], y.shape[2], tp.out_width))


def transposed_forward(module, input: DTensor, output_size, dims: int, fn) -> Tensor:
    """The forward of a spatial ``ConvTranspose{dims}d`` module on a sharded DTensor:
    ``output_padding`` from the global shape (as torch does), then ``fn`` (the spatial
    functional of that dimensionality)."""
    name = f"ConvTranspose{dims}d"
    if module.padding_mode != "zeros":
        raise ValueError(f"Only `zeros` padding mode is supported for {name}")
    output_padding = module._output_padding(
        input, output_size, module.stride, module.padding, module.kernel_size, dims,
        module.dilation,
    )  # fmt: skip
    return fn(
        input,
        module.weight,
        module.bias,
        module.stride,
        module.padding,
        tuple(output_padding),
        module.groups,
        module.dilation,
        what=f"{module.spatial_name or '<module>'} ({name}({module.extra_repr()}))",
    )


@register_spatial_module(nn.ConvTranspose2d)
class SpatialConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` that runs width-sharded on a ``Shard(3)`` DTensor input.

    ``parallelize`` turns a model's ``ConvTranspose2d`` modules into this class in place.
    ``output_size`` works as in torch (it is read from the global shape). A plain tensor
    input runs the ordinary single-device layer.
    """

    spatial_name: str = ""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input, output_size)
        return transposed_forward(self, input, output_size, 2, spatial_conv_transpose2d)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


@register_handler(F.conv_transpose2d)  # torch.conv_transpose2d is the same object
def _functional_conv_transpose2d(
    input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1
):
    """``F.conv_transpose2d`` called from model code on a width-sharded input."""
    return spatial_conv_transpose2d(
        input,
        weight,
        bias,
        _pair(stride),
        _pair(padding),
        _pair(output_padding),
        groups,
        _pair(dilation),
        what="F.conv_transpose2d",
    )
