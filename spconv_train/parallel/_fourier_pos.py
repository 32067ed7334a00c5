"""timm EdgeNeXt's Fourier positional encoding, built per strip or tile: timm builds the
whole image's encoding as a plain tensor, whose gradient, added to sharded tokens, would be
summed at the activation's size (refused by ``_pointwise.py``'s guard). It depends on
global coordinates alone: each rank builds its block of the last map a spatial layer took,
in timm's float32 steps (bitwise one device's). docs/models.md."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dims import wrap_local
from ._geometry import SpatialShardingError
from ._mode import register_spatial_module
from ._runtime import current_runtime
from ._sharding import block_slices, mesh_coords

TIMM_CLASS = "timm.models.edgenext.PositionalEncodingFourier"
_EPS = 1e-6  # timm's


def fourier_block(
    hidden: int, temperature: float, scale: float, size: tuple[int, int], rows: slice,
    cols: slice, device=None,
) -> Tensor:  # fmt: skip
    """``(2 * hidden, len(rows), len(cols))``: rows ``rows`` and columns ``cols`` of timm's
    encoding of an ``H x W = size`` map before its projection (per axis the interleaved sin /
    cos of the positions), the y half first."""
    dim_t = torch.arange(hidden, dtype=torch.int64, device=device).to(torch.float32)
    dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / hidden)
    axes = []
    for n, part in zip(size, (rows, cols), strict=True):
        pos = torch.arange(part.start + 1, part.stop + 1, dtype=torch.float32, device=device)
        pos = (pos / (torch.tensor(float(n), device=device) + _EPS) * scale)[:, None] / dim_t
        axes.append(torch.stack((pos[:, 0::2].sin(), pos[:, 1::2].cos()), dim=2).flatten(1))
    (y, x), h, w = axes, len(axes[0]), len(axes[1])
    both = (y[:, None, :].expand(h, w, hidden), x[None, :, :].expand(h, w, hidden))
    return torch.cat(both, dim=2).permute(2, 0, 1)


@register_spatial_module(TIMM_CLASS)
class SpatialFourierEncoding:
    """``PositionalEncodingFourier`` whose output is laid out like the map it encodes."""

    def forward(self, shape: tuple[int, int, int]):
        seen = current_runtime().last_image
        if seen is None:  # no sharded map in this forward: the plain encoding is right
            return super().forward(shape)
        mesh, placements, image = seen
        batch, height, width = (int(n) for n in shape)
        if (image[0], *image[2:]) != (batch, height, width):
            raise SpatialShardingError(
                f"module '{getattr(self, 'spatial_name', '?')}' (PositionalEncodingFourier): "
                f"asked to encode a {batch} x {height} x {width} map, but the last map a "
                f"spatial layer took is {image}, so its layout is unknown. Call it with the "
                f"shape of the activation it is added to (as timm's EdgeNeXt does)."
            )
        weight = self.token_projection.weight
        full = (batch, 2 * self.hidden_dim, height, width)
        b, _, rows, cols = block_slices(full, placements, mesh_coords(mesh))
        args = (self.hidden_dim, self.temperature, self.scale, (height, width), rows, cols)
        local = fourier_block(*args, weight.device).to(weight.dtype)
        local = local.expand(b.stop - b.start, -1, -1, -1)
        return self.token_projection(wrap_local(local.contiguous(), mesh, placements, full))
