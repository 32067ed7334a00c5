"""``ConvTranspose3d`` on an NCDHW volume sharded along D, H or W.

The plan of ``_conv_transpose.py`` (which input planes reach this rank's output planes)
applied along the sharded dim, moved last with a view (see ``_volume.py``): fetch those
planes, run the local ``F.conv_transpose3d`` with padding 0 and no bias along that dim, crop
or zero-pad to this rank's output planes, add the bias last.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._conv_transpose import _place, plan_conv_transpose, transposed_forward
from ._halo import gather_columns, sum_grad_over
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._sharding import enter, run_unsharded
from ._volume import leave_window, triple, unsharded, volume_layout
from ._window import WindowStep, saving_steps_by_reference


def spatial_conv_transpose3d(
    x: DTensor,
    weight: Tensor,
    bias: Tensor | None,
    stride,
    padding,
    output_padding,
    groups: int,
    dilation,
    what: str = "conv_transpose3d",
) -> DTensor:
    """``F.conv_transpose3d`` of a sharded volume; weight and bias gradients are summed over
    the spatial (and batch) ranks."""
    s, p, op, dil = triple(stride), triple(padding), triple(output_padding), triple(dilation)
    x, layout = volume_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_conv_transpose

        return tile_conv_transpose(x, layout, weight, bias, s, p, op, groups, dil, what)
    if not layout.width_sharded:

        def conv(t, w, b):
            return F.conv_transpose3d(t, w, b, s, p, op, groups, dil)

        return run_unsharded(x, layout, conv, weight, bias)
    d = layout.dim
    i = d - 2
    tp = plan_conv_transpose(
        what, x.shape[d], layout.sp_size, weight.shape[d], s[i], dil[i], p[i], op[i]
    )
    rank = layout.sp_rank
    local = enter(x).movedim(d, -1)
    if layout.sp_size == 1 and not tp.exchange.needed[0]:
        window = local.narrow(-1, 0, 0)
    else:  # every rank takes part: others may need its planes even if it needs none
        window = gather_columns(local, tp.exchange, rank, layout.sp_group)
    lo, hi = tp.windows[rank]
    if hi <= lo:
        # No input plane reaches this rank: convolve one zero plane so the weight and the
        # exchange stay in the graph and every rank runs the backward collectives.
        window = F.pad(window, (0, 1))
    groups_ = layout.grad_groups
    w = sum_grad_over(weight, groups_)
    window = window.movedim(-1, d)
    # Save the block by reference + thin halo planes rather than a copy of it (memory ~1/N).
    saving = contextlib.nullcontext()
    if hi > lo and layout.sp_size > 1 and torch.is_grad_enabled():
        step = WindowStep(d, tp.exchange, rank, 0, 0, window)
        saving = saving_steps_by_reference(window, local.movedim(-1, d), (step,))
    with saving:
        y = F.conv_transpose3d(window, w, None, s, unsharded(p, i), unsharded(op, i), groups, dil)
    o0, o1 = tp.out_bounds[rank]
    y = _place(y.movedim(d, -1), lo * s[i] - p[i], o0, o1).movedim(-1, d)
    if bias is not None:
        y = y + sum_grad_over(bias, groups_).view(1, -1, 1, 1, 1)
    return leave_window(y, x, layout, tp)


@register_spatial_module(nn.ConvTranspose3d)
class SpatialConvTranspose3d(nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on a volume sharded along D, H or W (``output_size`` works
    as in torch: it is read from the global shape)."""

    spatial_name: str = ""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not isinstance(input, DTensor):
            return super().forward(input, output_size)
        return transposed_forward(self, input, output_size, 3, spatial_conv_transpose3d)


@register_handler(F.conv_transpose3d)
def _functional_conv_transpose3d(
    input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1
):
    """``F.conv_transpose3d`` called from model code on a sharded volume."""
    args = (stride, padding, output_padding, groups, dilation)
    return spatial_conv_transpose3d(input, weight, bias, *args, what="F.conv_transpose3d")
