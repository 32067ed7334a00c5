"""Typed, validated configuration (stdlib + yaml only: no torch).

Errors are reported as ``ConfigError`` naming the dotted key, before torch or any
process group is touched::

    cfg = load_config("configs/unet.yaml", ["training.steps=5"])
    dp, sp = validate_for_world(cfg, world_size)
"""

from ._errors import ConfigError
from ._grid import choose_grid, empty_ranks
from ._io import config_to_dict, dump_config, load_config
from ._mesh import (
    data_width_per_rank,
    describe_grid,
    grid_mesh_dims,
    resolve_grid,
    spatial_grid,
    split_dim,
    validate_for_world,
)
from ._resume import (
    RESUME_POLICY,
    changed_settings,
    check_resume_changes,
    check_resume_steps,
    resume_policy,
)
from .schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainingConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RESUME_POLICY",
    "ScheduleConfig",
    "TrainingConfig",
    "changed_settings",
    "check_resume_changes",
    "check_resume_steps",
    "choose_grid",
    "empty_ranks",
    "config_to_dict",
    "data_width_per_rank",
    "describe_grid",
    "dump_config",
    "grid_mesh_dims",
    "load_config",
    "resolve_grid",
    "resume_policy",
    "spatial_grid",
    "split_dim",
    "validate_for_world",
]
