"""Spatial parallelism for NCHW images and NCDHW volumes on DTensor (width strips, H x W
tiles, volume blocks)::

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))  # or ("dp", "sp")
    model = parallelize(model, mesh)  # options: SpatialOptions fields
    x = distribute_tensor(img, mesh, [Shard(3)])
    y = model(x)                      # DTensor, Shard(3); y.full_tensor() == model(img)
    runtime_of(model).stats           # halo seconds / bytes / messages, gathers

Op authors use ``extend`` (``docs/extending.md``). Importing registers and patches nothing
(``parallelize`` installs). On CPU, create the gloo process groups inside
``with gloo_threads_idle():``. Torch only."""

from ._comm_threads import gloo_threads_idle, restore_gloo_threads
from ._dims import ParallelDims
from ._geometry import SpatialShardingError
from ._mode import parallelize
from ._replicas import full_parameters, is_sharded, replicate_gradients, shard_parameters
from ._runtime import (
    SpatialOptions,
    SpatialRuntime,
    SpatialStats,
    current_runtime,
    local_module,
    runtime_of,
)
from ._step_meters import CommAudit

# fmt: off
__all__ = [
    "CommAudit", "ParallelDims", "SpatialOptions", "SpatialRuntime", "SpatialShardingError",
    "SpatialStats", "current_runtime", "full_parameters", "gloo_threads_idle", "is_sharded",
    "local_module", "parallelize", "replicate_gradients", "restore_gloo_threads", "runtime_of",
    "shard_parameters",
]
# fmt: on
