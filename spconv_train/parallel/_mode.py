"""Route functional calls on width-sharded DTensors to spatial implementations.

Model code often calls ``F.interpolate``, ``F.adaptive_avg_pool2d``, ``F.conv2d`` directly
(torchvision's segmentation heads do). While a parallelized model runs, ``SpatialMode`` (a
``TorchFunctionMode``) sees every such call: when a DTensor is among the arguments it runs
the registered spatial handler; ops registered as *refused* raise a clear error, because
DTensor's own handling of them on ``Shard(3)`` either gathers the whole activation or is
silently wrong (see ``shared/DESIGN.md`` §2). Everything else passes through unchanged.

Handlers are registered by op name (``register_function``), so each op module declares its
own; the functional namespaces searched are ``torch``, ``torch.nn.functional`` and
``torch._C._nn`` (checked against torch 2.14).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ._geometry import SpatialShardingError

_NAMESPACES = (F, torch, torch._C._nn)
_HANDLERS: dict[int, Callable] = {}
_REFUSED: dict[int, str] = {}
_NAMES: dict[int, str] = {}


def _functions(name: str) -> list:
    found = [getattr(ns, name) for ns in _NAMESPACES if hasattr(ns, name)]
    if not found:
        raise KeyError(f"no torch function named {name!r}")
    return found


def register_function(*names: str) -> Callable[[Callable], Callable]:
    """Decorator: run ``handler(*args, **kwargs)`` instead of the torch function(s) ``names``
    whenever a DTensor is among the arguments while a parallelized model runs."""

    def deco(handler: Callable) -> Callable:
        for name in names:
            for fn in _functions(name):
                _HANDLERS[id(fn)] = handler
                _NAMES[id(fn)] = name
                _REFUSED.pop(id(fn), None)
        return handler

    return deco


def register_handler(*functions: Callable) -> Callable[[Callable], Callable]:
    """Decorator keyed by the function objects themselves (``torch.Tensor.mean``,
    ``F.pad``, ``torch.Tensor.__getitem__``, ...): run ``handler(*args, **kwargs)`` instead
    whenever a DTensor is among the arguments while a parallelized model runs. Tensor
    methods reach ``SpatialMode`` as the unbound method objects of ``torch.Tensor``."""

    def deco(handler: Callable) -> Callable:
        for fn in functions:
            _HANDLERS[id(fn)] = handler
            _NAMES[id(fn)] = getattr(fn, "__name__", repr(fn))
            _REFUSED.pop(id(fn), None)
        return handler

    return deco


def refuse_function(name: str, reason: str) -> None:
    """Make ``name`` raise on width-sharded DTensors (unless a handler is registered)."""
    for fn in _functions(name):
        if id(fn) not in _HANDLERS:
            _REFUSED[id(fn)] = reason
            _NAMES[id(fn)] = name


def _has_dtensor(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, DTensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, DTensor) for b in a):
            return True
    return False


class SpatialMode(TorchFunctionMode):
    """Active while a parallelized model runs its forward (``parallelize`` installs it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = id(func)
        if (key in _HANDLERS or key in _REFUSED) and _has_dtensor(args, kwargs):
            if key in _HANDLERS:
                return _HANDLERS[key](*args, **kwargs)
            raise SpatialShardingError(
                f"torch.nn.functional.{_NAMES[key]} is not supported on a width-sharded "
                f"DTensor: {_REFUSED[key]}"
            )
        return func(*args, **kwargs)


# Ops that DTensor would run by gathering the width or that would be wrong on strips; each
# op module replaces its entries with a handler.
for _name in (
    "conv1d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "max_pool1d",
    "max_pool2d",
    "max_pool2d_with_indices",
    "avg_pool2d",
    "lp_pool2d",
    "adaptive_avg_pool2d",
    "adaptive_max_pool2d",
    "adaptive_max_pool2d_with_indices",
    "fractional_max_pool2d",
    "interpolate",
    "grid_sample",
    "affine_grid",
    "batch_norm",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "local_response_norm",
    "pad",
    "unfold",
    "fold",
    "pixel_shuffle",
    "pixel_unshuffle",
    "cross_entropy",
    "nll_loss",
    "embedding",
):
    refuse_function(
        _name,
        "no spatial implementation (it would gather the whole image or mix strips wrongly). "
        "Use a supported layer, or run this part of the model on a gathered tensor explicitly "
        "(x.full_tensor()).",
    )
