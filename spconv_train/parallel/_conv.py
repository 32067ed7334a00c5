"""Width-sharded ``Conv2d``: fetch the halo, run the ordinary convolution on the window.

Every ``nn.Conv2d`` configuration is covered: any kernel (even ones too), stride, dilation,
groups, padding given as int, tuple, ``'same'`` or ``'valid'``, and the padding modes
zeros/reflect/replicate/circular. The output is again a ``Shard(3)`` DTensor whose strips
follow DTensor's chunking of the output width.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._halo import sum_grad_over
from ._halo_conv import halo_conv2d, plan_split
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._runtime import current_runtime
from ._sharding import enter, leave, run_unsharded, spatial_layout
from ._window import gather_window, plan_window, saving_plain_window


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv2d_pads(padding, kernel: tuple[int, int], dilation: tuple[int, int]):
    """``(top, bottom, left, right)`` of a ``Conv2d``/``F.conv2d`` ``padding`` given as an int,
    a pair, ``'valid'`` or ``'same'`` (one more on the bottom/right for even kernels, as
    PyTorch does)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding != "same":
            raise ValueError(f"conv2d: padding {padding!r} is not 'same', 'valid' or a number")
        th, tw = (d * (k - 1) for d, k in zip(dilation, kernel, strict=True))
        return th // 2, th - th // 2, tw // 2, tw - tw // 2
    ph, pw = _pair(padding)
    return ph, ph, pw, pw


def conv_padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` padding a ``Conv2d`` applies *now*.

    Read from the live ``padding``/``dilation``/``kernel_size`` attributes, as
    ``nn.Conv2d._conv_forward`` does for zero padding: code that edits a layer after
    construction (smp's ``make_dilated``) changes them, while the cached
    ``_reversed_padding_repeated_twice`` keeps the constructor's values. The other padding
    modes *do* use that cache in ``nn.Conv2d`` (it pads with ``F.pad`` first), so they read
    it too: the sharded layer computes exactly what the single-device layer computes."""
    if conv.padding_mode != "zeros":
        wl, wr, ht, hb = conv._reversed_padding_repeated_twice
        return ht, hb, wl, wr
    return conv2d_pads(conv.padding, _pair(conv.kernel_size), _pair(conv.dilation))


def spatial_conv2d(
    x: DTensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int, int, int],
    dilation: tuple[int, int],
    groups: int,
    padding_mode: str = "zeros",
    what: str = "conv2d",
) -> DTensor:
    """2-D convolution of a width-sharded DTensor ``x``; same result as ``F.conv2d`` on the
    whole tensor. ``padding`` is ``(top, bottom, left, right)``. Weight and bias gradients
    are summed over the ranks holding other strips (and other batch parts)."""
    x, layout = spatial_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_conv  # the tile ops build on this module's siblings

        return tile_conv(
            x, layout, weight, bias, stride, padding, dilation, groups, padding_mode, what
        )
    pt, pb, pl, pr = padding
    if not layout.width_sharded or layout.sp_size == 1:
        # Whole rows on every rank (one spatial rank included): the plain layer, at its cost.
        mode = "constant" if padding_mode == "zeros" else padding_mode
        inside = padding_mode == "zeros" and pt == pb and pl == pr

        def conv(t, w, b):
            if inside:
                return F.conv2d(t, w, b, stride, (pt, pl), dilation, groups)
            t = F.pad(t, (pl, pr, pt, pb), mode=mode) if any(padding) else t
            return F.conv2d(t, w, b, stride, 0, dilation, groups)

        return run_unsharded(x, layout, conv, weight, bias)
    kh, kw = weight.shape[-2:]
    wp = plan_window(
        what, x.shape[layout.dim], layout.sp_size, kw, stride[1], dilation[1], pl, pr, padding_mode
    )
    rank = layout.sp_rank
    local = enter(x)
    # Zero height padding is cheapest inside the convolution itself when it is symmetric.
    conv_pad_h = pt if padding_mode == "zeros" and pt == pb else 0
    split = None
    if padding_mode == "zeros" and pt == pb and current_runtime().options.split_halo_conv:
        split = plan_split(wp, rank, kw, stride[1], dilation[1], pl)
    if split is not None:
        # No window copy: interior from the strip itself, edges from thin windows (overlapped).
        w, b = sum_grad_over(weight, layout.grad_groups), sum_grad_over(bias, layout.grad_groups)
        group = layout.sp_group
        out = halo_conv2d(local, w, b, wp, split, rank, group, stride, pt, dilation, groups)
        return leave(out, layout, (x.shape[0], out.shape[1], out.shape[2], wp.out_width))
    pad_h = (0, 0) if conv_pad_h or (pt == 0 and pb == 0) else (pt, pb)
    window = gather_window(local, wp, rank, layout.sp_group, padding_mode, 0.0, pad_h)
    groups_ = layout.grad_groups
    w, b = sum_grad_over(weight, groups_), sum_grad_over(bias, groups_)
    if padding_mode == "zeros":
        # Save the strip by reference + thin halos, not a second copy of it (memory ~1/N).
        with saving_plain_window(window, local, wp, rank):
            out = F.conv2d(window, w, b, stride, (conv_pad_h, 0), dilation, groups)
    else:
        out = F.conv2d(window, w, b, stride, (conv_pad_h, 0), dilation, groups)
    o0, o1 = wp.out_bounds[rank]
    assert out.shape[-1] == o1 - o0, (what, out.shape, wp.out_bounds, rank)
    return leave(out, layout, (x.shape[0], out.shape[1], out.shape[2], wp.out_width))


@register_spatial_module(nn.Conv2d)
class SpatialConv2d(nn.Conv2d):
    """``nn.Conv2d`` that runs width-sharded on a ``Shard(3)`` DTensor input.

    ``parallelize`` turns a model's ``Conv2d`` modules into this class in place, so
    parameters, hooks and ``state_dict`` keys stay exactly those of the original. A plain
    tensor input runs the ordinary single-device convolution.
    """

    spatial_name: str = ""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, DTensor):
            return super().forward(x)
        return spatial_conv2d(
            x,
            self.weight,
            self.bias,
            _pair(self.stride),
            conv_padding(self),
            _pair(self.dilation),
            self.groups,
            self.padding_mode,
            what=f"{self.spatial_name or '<module>'} (Conv2d({self.extra_repr()}))",
        )


@register_handler(F.conv2d)  # torch.conv2d is the same object
def _functional_conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``F.conv2d`` called from model code on a width-sharded input."""
    stride, dilation = _pair(stride), _pair(dilation)
    pads = conv2d_pads(padding, tuple(weight.shape[-2:]), dilation)
    return spatial_conv2d(input, weight, bias, stride, pads, dilation, groups, what="F.conv2d")
