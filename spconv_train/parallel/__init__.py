"""Spatial (width) parallelism for NCHW models on DTensor ``Shard(3)``.

Public API::

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))  # or ("dp", "sp")
    model = parallelize(model, mesh)
    x = distribute_tensor(img, mesh, [Shard(3)])
    y = model(x)                      # DTensor, Shard(3); y.full_tensor() == model(img)

This package depends only on torch.
"""

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from . import (  # noqa: F401  (op modules register their handlers on import)
    _broadcast,
    _channels,
    _conv,
    _conv_transpose,
    _interpolate,
    _linear,
    _norm,
    _pad,
    _pointwise,
    _pool,
    _reduce,
    _slicing,
)
from ._conv import SpatialConv2d, spatial_conv2d
from ._conv_transpose import SpatialConvTranspose2d, spatial_conv_transpose2d
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds, shard_bounds
from ._halo import HALO_SECONDS, gather_columns, sum_grad_over
from ._interpolate import SpatialUpsample, spatial_interpolate
from ._mode import SpatialMode, refuse_function, register_function, register_handler
from ._norm import (
    SpatialBatchNorm2d,
    SpatialGroupNorm,
    SpatialInstanceNorm2d,
    SpatialSyncBatchNorm,
    spatial_batch_norm,
    spatial_group_norm,
    spatial_instance_norm,
)
from ._parallelize import parallelize, refuse_module, register_spatial_module
from ._pool import (
    SpatialAdaptiveAvgPool2d,
    SpatialAdaptiveMaxPool2d,
    SpatialAvgPool2d,
    SpatialMaxPool2d,
    spatial_adaptive_avg_pool2d,
    spatial_adaptive_max_pool2d,
    spatial_avg_pool2d,
    spatial_max_pool2d,
)
from ._window import WindowPlan, gather_window, plan_window

__all__ = [
    "DTensor",
    "DeviceMesh",
    "ExchangePlan",
    "HALO_SECONDS",
    "Partial",
    "Replicate",
    "Shard",
    "SpatialAdaptiveAvgPool2d",
    "SpatialAdaptiveMaxPool2d",
    "SpatialAvgPool2d",
    "SpatialBatchNorm2d",
    "SpatialConv2d",
    "SpatialConvTranspose2d",
    "SpatialUpsample",
    "SpatialGroupNorm",
    "SpatialInstanceNorm2d",
    "SpatialMaxPool2d",
    "SpatialSyncBatchNorm",
    "SpatialMode",
    "SpatialShardingError",
    "WindowPlan",
    "all_shard_bounds",
    "distribute_tensor",
    "gather_columns",
    "gather_window",
    "init_device_mesh",
    "parallelize",
    "plan_window",
    "refuse_function",
    "refuse_module",
    "register_function",
    "register_handler",
    "register_spatial_module",
    "shard_bounds",
    "spatial_adaptive_avg_pool2d",
    "spatial_adaptive_max_pool2d",
    "spatial_avg_pool2d",
    "spatial_batch_norm",
    "spatial_conv2d",
    "spatial_conv_transpose2d",
    "spatial_interpolate",
    "spatial_group_norm",
    "spatial_instance_norm",
    "spatial_max_pool2d",
    "sum_grad_over",
]
