"""Spatial (width) parallelism for NCHW models on DTensor ``Shard(3)``.

Using it::

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))  # or ("dp", "sp")
    model = parallelize(model, mesh)  # options: save_windows_by_reference, allow_gather
    x = distribute_tensor(img, mesh, [Shard(3)])
    y = model(x)                      # DTensor, Shard(3); y.full_tensor() == model(img)
    runtime_of(model).stats           # halo seconds / bytes / messages, gathers

Extending it (``docs/extending.md``): ``register_handler(fn)`` routes a torch function or
Tensor method to your handler; inside it ``spatial_layout`` reads the layout, ``enter`` /
``leave`` go to the local strip and back, ``plan_window`` + ``gather_window`` (or
``ExchangePlan`` + ``gather_columns``) fetch a halo, ``sum_grad_over(param,
layout.grad_groups)`` completes a parameter gradient, and ``current_runtime()`` gives the
options and statistics. ``register_spatial_module`` swaps a module class in ``parallelize``.
``shard_parameters(model, blocks)`` adds FSDP2 over the whole mesh (each rank keeps
``1 / world`` of the parameters, gradients and optimizer state).
On CPU, create the gloo process groups (the mesh) inside ``with gloo_threads_idle():``:
gloo's helper threads then stop taking cores from the compute threads (``_comm_threads.py``).

Every name in ``__all__`` is public and documented; ``parallel._x`` modules are not.
This package depends only on torch.
"""

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from . import (  # noqa: F401  (op modules register their handlers on import)
    _broadcast,
    _channels,
    _conv,
    _conv3d,
    _conv_transpose,
    _conv_transpose3d,
    _interpolate,
    _linear,
    _norm,
    _norm3d,
    _pad,
    _pointwise,
    _pool,
    _reduce,
    _scan,
    _slicing,
)
from ._comm_audit import CommAudit
from ._comm_threads import gloo_threads_idle, restore_gloo_threads
from ._conv import SpatialConv2d, spatial_conv2d
from ._conv3d import SpatialConv3d, spatial_conv3d
from ._conv_transpose import SpatialConvTranspose2d, spatial_conv_transpose2d
from ._conv_transpose3d import SpatialConvTranspose3d, spatial_conv_transpose3d
from ._ddp import local_module, replicate_gradients
from ._fsdp import full_parameters, is_sharded, shard_parameters
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds, shard_bounds
from ._halo import gather_columns, sum_grad_over
from ._interpolate import SpatialUpsample, spatial_interpolate
from ._mode import SpatialMode, refuse_handler, register_handler
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
from ._registry import HandlerRegistry
from ._runtime import SpatialOptions, SpatialRuntime, SpatialStats, current_runtime, runtime_of
from ._sharding import (
    SpatialLayout,
    block_slices,
    enter,
    leave,
    mesh_coords,
    run_unsharded,
    sharded_dim,
    sharding_mesh_dims,
    spatial_layout,
)
from ._window import WindowPlan, gather_window, plan_window

__all__ = [
    "CommAudit",
    "DTensor",
    "DeviceMesh",
    "ExchangePlan",
    "HandlerRegistry",
    "Partial",
    "Replicate",
    "Shard",
    "SpatialAdaptiveAvgPool2d",
    "SpatialAdaptiveMaxPool2d",
    "SpatialAvgPool2d",
    "SpatialBatchNorm2d",
    "SpatialConv2d",
    "SpatialConv3d",
    "SpatialConvTranspose2d",
    "SpatialConvTranspose3d",
    "SpatialGroupNorm",
    "SpatialInstanceNorm2d",
    "SpatialLayout",
    "SpatialMaxPool2d",
    "SpatialMode",
    "SpatialOptions",
    "SpatialRuntime",
    "SpatialShardingError",
    "SpatialStats",
    "SpatialSyncBatchNorm",
    "SpatialUpsample",
    "WindowPlan",
    "all_shard_bounds",
    "block_slices",
    "current_runtime",
    "distribute_tensor",
    "enter",
    "full_parameters",
    "gather_columns",
    "gather_window",
    "gloo_threads_idle",
    "init_device_mesh",
    "is_sharded",
    "leave",
    "local_module",
    "mesh_coords",
    "parallelize",
    "plan_window",
    "refuse_handler",
    "refuse_module",
    "register_handler",
    "register_spatial_module",
    "replicate_gradients",
    "restore_gloo_threads",
    "run_unsharded",
    "runtime_of",
    "shard_bounds",
    "shard_parameters",
    "sharded_dim",
    "sharding_mesh_dims",
    "spatial_adaptive_avg_pool2d",
    "spatial_adaptive_max_pool2d",
    "spatial_avg_pool2d",
    "spatial_batch_norm",
    "spatial_conv2d",
    "spatial_conv3d",
    "spatial_conv_transpose2d",
    "spatial_conv_transpose3d",
    "spatial_group_norm",
    "spatial_instance_norm",
    "spatial_interpolate",
    "spatial_layout",
    "spatial_max_pool2d",
    "sum_grad_over",
]
