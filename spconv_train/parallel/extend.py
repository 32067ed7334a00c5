"""The op-author API of ``spconv_train.parallel``: make your own op or layer spatial.

``docs/extending.md`` walks through it. Handlers are registered by its calls, never by
importing this module; each calls ``install()`` first, so a handler you register takes
precedence over a built-in one for the same function.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from . import _parallelize
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds, shard_bounds
from ._halo import gather_columns, sum_grad_over
from ._mode import SpatialMode, install
from ._registry import DEFAULT_REGISTRY, HandlerRegistry
from ._runtime import current_runtime
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


def register_handler(*functions: Callable, traced: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: while a parallelized model runs, a call of any of ``functions`` (the
    function objects: ``F.pad``, ``torch.batch_norm``, ``torch.Tensor.mean``) with a DTensor
    among its arguments runs the handler instead, with the same arguments; it returns what
    the function returns. For every model (``runtime.registry.register``: one model), over
    a built-in handler. Under ``torch.compile`` it runs eagerly (a graph break) unless
    ``traced=True`` (Dynamo inlines it: handlers without DTensor ops only)."""
    install()
    return DEFAULT_REGISTRY.register(*functions, traced=traced)


def refuse_handler(*functions: Callable, reason: str) -> None:
    """Make ``functions`` raise ``SpatialShardingError`` with ``reason`` when called on a
    sharded DTensor (a function that has a handler keeps it)."""
    install()
    DEFAULT_REGISTRY.refuse(*functions, reason=reason)


def register_spatial_module(base: type[nn.Module] | str) -> Callable[[type], type]:
    """Class decorator: ``parallelize`` turns every module of exactly type ``base`` into the
    decorated subclass in place (which must add no parameter or buffer), over a built-in
    swap. ``base`` may be a qualified name (``"timm.models.edgenext.PositionalEncodingFourier"``)
    of a class not imported: the decorated class is then a mixin put in front of it."""
    install()
    return _parallelize.register_spatial_module(base)


def refuse_module(base: type[nn.Module], reason: str) -> None:
    """Make ``parallelize`` refuse models holding a module of exactly type ``base``, naming
    its path and ``reason`` (before changing anything)."""
    install()
    _parallelize.refuse_module(base, reason)
