"""Processes and meshes: torchrun / c10d process groups, the device mesh, and the CPU set-up
of each rank.

- ``process_groups``: ``init_distributed`` (gloo on CPU, NCCL on GPU; timeouts, restarts),
  ``build_mesh`` (``dp`` x spatial dims), ``shutdown``, small collectives of Python objects.
- ``launch_store``: the launch-long store that lets every node of a restarted job follow
  one decision.
- ``cpu_affinity``: binding each local rank to its own cores.
- ``cpu_malloc``: glibc malloc tuning for large activations.
"""

from spconv_train.distributed.process_groups import (
    DistInfo,
    build_mesh,
    default_timeout_s,
    env_rank,
    env_world_size,
    first_to_report,
    free_port,
    gather_all,
    init_distributed,
    is_peer_failure,
    peak_memory_mb,
    restart_count,
    seed_everything,
    shutdown,
    spatial_mesh,
)

__all__ = [
    "DistInfo",
    "build_mesh",
    "default_timeout_s",
    "env_rank",
    "env_world_size",
    "first_to_report",
    "free_port",
    "gather_all",
    "init_distributed",
    "is_peer_failure",
    "peak_memory_mb",
    "restart_count",
    "seed_everything",
    "shutdown",
    "spatial_mesh",
]
