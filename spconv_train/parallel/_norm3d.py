"""``BatchNorm3d``/``InstanceNorm3d`` on an NCDHW volume sharded along D, H or W.

The statistics code in ``_norm.py`` takes volumes as they are (it counts elements, whatever
their spatial layout); this module only swaps the 3-D module classes. ``GroupNorm`` is
registered there already and works on volumes too.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._norm import SpatialInstanceNorm2d, _SpatialBatchNorm
from ._parallelize import register_spatial_module


@register_spatial_module(nn.BatchNorm3d)
class SpatialBatchNorm3d(_SpatialBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` on a sharded volume: statistics over the whole global batch and
    volume (reduced over the spatial and data-parallel ranks)."""


@register_spatial_module(nn.InstanceNorm3d)
class SpatialInstanceNorm3d(nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` on a sharded volume (statistics reduced over the spatial ranks)."""

    spatial_name: str = ""

    def _apply_instance_norm(self, x: Tensor) -> Tensor:
        if not isinstance(x, DTensor):
            return super()._apply_instance_norm(x)
        # The 2-D class's DTensor branch does not depend on the number of dims.
        return SpatialInstanceNorm2d._apply_instance_norm(self, x)
