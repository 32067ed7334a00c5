"""``MaxPool3d``/``AvgPool3d`` on an NCDHW volume sharded along D, H or W.

As in ``_pool.py`` (whose window planning and divisor rules are reused): fetch the halo
along the sharded dim (``-inf`` edge padding for max, zeros for average), run the unchanged
local op with padding 0 along that dim. ``ceil_mode`` along the sharded dim becomes extra
high-side padding; average pooling then divides by the divisor PyTorch uses on the whole
volume (``count_include_pad``, ``divisor_override``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._geometry import SpatialShardingError
from ._parallelize import register_spatial_module
from ._pool import _counts, _pool_plan, _register, _what
from ._sharding import run_unsharded
from ._volume import (
    gather_volume_window,
    leave_window,
    saving_volume_window,
    triple,
    unsharded,
    volume_layout,
)


def spatial_max_pool3d(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
    what: str = "max_pool3d",
) -> DTensor:
    """``F.max_pool3d`` on a sharded volume (same values and gradients)."""
    k, p, dil = triple(kernel_size), triple(padding), triple(dilation)
    s = triple(stride) if stride else k
    # torch's own argument checks, computing nothing
    F.max_pool3d(torch.empty(x.shape, device="meta"), k, s, p, dil, ceil_mode)
    if return_indices:
        raise SpatialShardingError(
            f"{what}: return_indices is not supported on a sharded volume (no MaxUnpool3d "
            f"either); use the values only"
        )
    x, layout = volume_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_max_pool

        return tile_max_pool(x, layout, k, s, p, dil, ceil_mode, False, what)
    if not layout.width_sharded:
        return run_unsharded(x, layout, lambda t: F.max_pool3d(t, k, s, p, dil, ceil_mode))
    d = layout.dim
    i = d - 2
    wp, _ = _pool_plan(what, x.shape[d], layout.sp_size, k[i], s[i], dil[i], p[i], ceil_mode)
    win = gather_volume_window(x, layout, wp, "zeros", float("-inf"))
    with saving_volume_window(win, x, layout, wp, "zeros", float("-inf")):
        out = F.max_pool3d(win, k, s, unsharded(p, i), dil, ceil_mode)
    return leave_window(out, x, layout, wp)


def spatial_avg_pool3d(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    what: str = "avg_pool3d",
) -> DTensor:
    """``F.avg_pool3d`` on a sharded volume; padding and ceil-mode overhang are counted
    exactly as PyTorch counts them on the whole volume."""
    k, p = triple(kernel_size), triple(padding)
    s = triple(stride) if stride else k
    args = (ceil_mode, count_include_pad, divisor_override)
    F.avg_pool3d(torch.empty(x.shape, device="meta"), k, s, p, *args)
    x, layout = volume_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_avg_pool

        return tile_avg_pool(x, layout, k, s, p, *args, what)
    if not layout.width_sharded:
        return run_unsharded(x, layout, lambda t: F.avg_pool3d(t, k, s, p, *args))
    d = layout.dim
    i = d - 2
    wp, pad_hi = _pool_plan(what, x.shape[d], layout.sp_size, k[i], s[i], 1, p[i], ceil_mode)
    win = gather_volume_window(x, layout, wp, "zeros", 0.0)
    # Width-padding planes are ordinary zeros in the window: the local divisor is right
    # unless padding must not be counted or a ceil window overhangs (see _pool.py).
    if divisor_override or (pad_hi == p[i] and (count_include_pad or p[i] == 0)):
        out = F.avg_pool3d(win, k, s, unsharded(p, i), *args)
        return leave_window(out, x, layout, wp)
    sums = F.avg_pool3d(win, k, s, unsharded(p, i), ceil_mode, True, 1)
    factors = []
    for j in range(3):
        if j == i:
            lo, hi = wp.out_bounds[layout.sp_rank]
        else:
            lo, hi = 0, sums.shape[j + 2]
        f = _counts(x.shape[j + 2], k[j], s[j], p[j], lo, hi, count_include_pad)
        factors.append(torch.tensor(f, dtype=sums.dtype, device=sums.device))
    div = factors[0][:, None, None] * factors[1][None, :, None] * factors[2][None, None, :]
    return leave_window(sums / div, x, layout, wp)


@register_spatial_module(nn.MaxPool3d)
class SpatialMaxPool3d(nn.MaxPool3d):
    """``nn.MaxPool3d`` on a volume sharded along D, H or W."""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, DTensor):
            return super().forward(x)
        args = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return spatial_max_pool3d(x, *args, self.return_indices, what=_what(self))


@register_spatial_module(nn.AvgPool3d)
class SpatialAvgPool3d(nn.AvgPool3d):
    """``nn.AvgPool3d`` on a volume sharded along D, H or W."""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, DTensor):
            return super().forward(x)
        args = (self.kernel_size, self.stride, self.padding, self.ceil_mode)
        args += (self.count_include_pad, self.divisor_override)
        return spatial_avg_pool3d(x, *args, what=_what(self))


# F.max_pool3d dispatches on return_indices (SpatialMode sees the dispatcher itself);
# torch.max_pool3d is a separate object. F.avg_pool3d is torch._C._nn.avg_pool3d.
_register(spatial_max_pool3d, F.max_pool3d, torch.max_pool3d)
# the always-a-pair forms (F.max_pool3d(..., return_indices=True) calls one of them): routed
# so that they refuse clearly instead of running through DTensor's gathering fallback
_nn = torch._C._nn
_register(spatial_max_pool3d, F.max_pool3d_with_indices, _nn.max_pool3d_with_indices, pair_after=6)
_register(spatial_avg_pool3d, F.avg_pool3d)

from . import _adaptive3d  # noqa: E402, F401  (registers the adaptive 3-D pools)
