"""``Conv3d`` on an NCDHW volume sharded along one of D, H, W (``Shard(2|3|4)``).

Every ``nn.Conv3d`` configuration: any kernel (even ones too), stride, dilation, groups,
padding as int, triple, ``'same'`` or ``'valid'``, padding modes zeros/reflect/replicate/
circular. The halo along the sharded dim is planned and fetched by the generic window code
(``_volume.py``); the local ``F.conv3d`` runs with padding 0 along that dim.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._halo import sum_grad_over
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._sharding import run_unsharded
from ._volume import (
    gather_volume_window,
    leave_window,
    pad_local_dims,
    saving_volume_window,
    triple,
    volume_layout,
)
from ._window import plan_window

Pads = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def conv3d_pads(padding, kernel, dilation) -> Pads:
    """``((d_lo, d_hi), (h_lo, h_hi), (w_lo, w_hi))`` of a ``Conv3d``/``F.conv3d`` padding
    given as an int, a triple, ``'valid'`` or ``'same'`` (the extra one of an even kernel
    goes at the end, as PyTorch does)."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * 3  # type: ignore[return-value]
        if padding != "same":
            raise ValueError(f"conv3d: padding {padding!r} is not 'same', 'valid' or a number")
        totals = [d * (k - 1) for d, k in zip(triple(dilation), triple(kernel), strict=True)]
        return tuple((t // 2, t - t // 2) for t in totals)  # type: ignore[return-value]
    return tuple((p, p) for p in triple(padding))  # type: ignore[return-value]


def conv3d_padding(conv: nn.Conv3d) -> Pads:
    """Padding a ``Conv3d`` applies now (live attributes for zeros, the cached reversed
    padding for the other modes, exactly as ``nn.Conv3d`` itself does; see ``_conv.py``)."""
    if conv.padding_mode != "zeros":
        wl, wr, ht, hb, df, db = conv._reversed_padding_repeated_twice
        return ((df, db), (ht, hb), (wl, wr))
    return conv3d_pads(conv.padding, conv.kernel_size, conv.dilation)


def spatial_conv3d(
    x: DTensor,
    weight: Tensor,
    bias: Tensor | None,
    stride,
    padding: Pads,
    dilation,
    groups: int,
    padding_mode: str = "zeros",
    what: str = "conv3d",
) -> DTensor:
    """3-D convolution of a volume sharded along one spatial dim; same result as
    ``F.conv3d`` on the whole volume. ``padding`` is ``((lo, hi),) * 3`` for D, H, W. Weight
    and bias gradients are summed over the spatial (and batch) ranks."""
    stride, dilation = triple(stride), triple(dilation)
    x, layout = volume_layout(x, what, tiles=True)
    if layout.is_tile:  # two or three of D, H, W sharded
        from ._tiles_ops import tile_conv  # imports the 2-D ops' modules

        flat = tuple(a for pair in padding for a in pair)
        args = (stride, flat, dilation, groups, padding_mode, what)
        return tile_conv(x, layout, weight, bias, *args)
    mode = "constant" if padding_mode == "zeros" else padding_mode
    symmetric_zeros = padding_mode == "zeros" and all(a == b for a, b in padding)
    if not layout.width_sharded or layout.sp_size == 1:
        # Whole planes on every rank (one spatial rank included): the plain op, at its cost.

        def conv(t, w, b):
            if symmetric_zeros:  # padded inside the convolution: no padded copy to keep
                return F.conv3d(t, w, b, stride, tuple(a for a, _ in padding), dilation, groups)
            t = pad_local_dims(t, padding, -1, mode)
            return F.conv3d(t, w, b, stride, 0, dilation, groups)

        return run_unsharded(x, layout, conv, weight, bias)
    d = layout.dim
    i = d - 2
    k = weight.shape[d]
    lo, hi = padding[i]
    wp = plan_window(
        what, x.shape[d], layout.sp_size, k, stride[i], dilation[i], lo, hi, padding_mode
    )
    win = gather_volume_window(x, layout, wp, padding_mode)
    conv_pad = [0, 0, 0]
    local_pads = list(padding)
    local_pads[i] = (0, 0)
    if padding_mode == "zeros" and all(a == b for a, b in local_pads):
        # Symmetric zero padding is cheapest inside the convolution itself.
        conv_pad = [a for a, _ in local_pads]
    else:
        win = pad_local_dims(win, padding, d, mode)
    groups_ = layout.grad_groups
    w, b = sum_grad_over(weight, groups_), sum_grad_over(bias, groups_)
    # Save the block by reference + thin halo planes, not the window copy (memory ~1/N).
    with saving_volume_window(win, x, layout, wp, mode):
        out = F.conv3d(win, w, b, stride, tuple(conv_pad), dilation, groups)
    o0, o1 = wp.out_bounds[layout.sp_rank]
    assert out.shape[d] == o1 - o0, (what, out.shape, wp.out_bounds)
    return leave_window(out, x, layout, wp)


@register_spatial_module(nn.Conv3d)
class SpatialConv3d(nn.Conv3d):
    """``nn.Conv3d`` that runs on an NCDHW DTensor sharded along D, H or W.

    ``parallelize`` turns a model's ``Conv3d`` modules into this class in place (same
    parameters and ``state_dict``). A plain tensor input runs the ordinary convolution."""

    spatial_name: str = ""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, DTensor):
            return super().forward(x)
        return spatial_conv3d(
            x,
            self.weight,
            self.bias,
            self.stride,
            conv3d_padding(self),
            self.dilation,
            self.groups,
            self.padding_mode,
            what=f"{self.spatial_name or '<module>'} (Conv3d({self.extra_repr()}))",
        )


@register_handler(F.conv3d)
def _functional_conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``F.conv3d`` called from model code on a sharded volume."""
    pads = conv3d_pads(padding, tuple(weight.shape[-3:]), dilation)
    return spatial_conv3d(input, weight, bias, stride, pads, dilation, groups, what="F.conv3d")
