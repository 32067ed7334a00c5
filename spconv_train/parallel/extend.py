"""The op-author API of ``spconv_train.parallel``: make your own op or layer spatial.

``docs/extending.md`` walks through it. Handlers are registered by its calls, never by
importing this module; each calls ``install()`` first, so a handler you register takes
precedence over a built-in one for the same function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from . import _mode
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds, shard_bounds
from ._halo import gather_columns, sum_grad_over
from ._mode import SpatialMode, install
from ._runtime import DEFAULT_REGISTRY, HandlerRegistry, current_runtime
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
from ._tiles import HaloWindow, halo_window
from ._window import WindowPlan, gather_window, plan_window

# fmt: off
__all__ = [
    "ExchangePlan", "HaloWindow", "HandlerRegistry", "SpatialLayout", "SpatialMode",
    "SpatialShardingError", "WindowPlan", "all_shard_bounds", "block_slices", "current_runtime",
    "enter", "gather_columns", "gather_window", "halo_window", "install", "leave", "mesh_coords",
    "plan_window", "refuse_handler", "refuse_module", "register_handler", "register_spatial_module",
    "run_unsharded", "shard_bounds", "sharded_dim", "sharding_mesh_dims", "spatial_layout",
    "sum_grad_over",
]
# fmt: on


def _installing(fn: Callable, name: str) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        install()  # the built-ins first: a registration here takes precedence
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = name  # help(), tracebacks, pickle: this module's name
    call.__module__ = __name__
    return call


register_handler = _installing(DEFAULT_REGISTRY.register, "register_handler")
refuse_handler = _installing(DEFAULT_REGISTRY.refuse, "refuse_handler")
register_spatial_module = _installing(_mode.register_spatial_module, "register_spatial_module")
refuse_module = _installing(_mode.refuse_module, "refuse_module")
