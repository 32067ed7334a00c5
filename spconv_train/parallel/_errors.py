"""Name the module an op runs in, and turn DTensor's own errors into clear refusals.

``module_label`` formats a spatial layer's ``path (Type(extra_repr))`` once per module and
keeps it there: the hyperparameters are fixed once it is built, so formatting
``extra_repr`` on every forward would be repeated work. ``parallelize`` renaming the module
(its ``spatial_name``) rebuilds it.

An op without a spatial handler falls through to DTensor, whose failures on a sharded
activation read like internal errors ("aten.native_layer_norm.default got mixed
torch.Tensor and DTensor", "Cannot unflatten unevenly sharded tensor"). ``SpatialMode``
runs such ops through ``run_dtensor_op``: a DTensor error becomes a
``SpatialShardingError`` naming the op, the module path and the placements, with the
original message kept as the cause.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from ._dtensor_guard import _active
from ._geometry import SpatialShardingError
from ._registry import function_name

#: Fragments of DTensor's own error messages (torch 2.14) that mean "no sharding rule".
_DTENSOR_ERRORS = (
    "DTensor",
    "unevenly sharded",
    "_StridedShard",
    "sharding strateg",
    "sharding propagation",
)


def module_path() -> str:
    """Path of the innermost module of the parallelized model running now (``<model>``
    outside one)."""
    guard = _active()
    return guard.modules[-1] if guard is not None and guard.modules else "<model>"


def module_label(module: nn.Module) -> str:
    """``"<spatial_name> (<TorchClass>(<extra_repr>))"`` of ``module``, cached on it (the
    class is the first ``torch.*`` one in its MRO: ``Conv2d`` for ``SpatialConv2d``)."""
    name = getattr(module, "spatial_name", "") or "<module>"
    cached = module.__dict__.get("_spatial_label")
    if cached is None or cached[0] != name:
        base = next(c for c in type(module).__mro__ if c.__module__.startswith("torch."))
        cached = (name, f"{name} ({base.__name__}({module.extra_repr()}))")
        module.__dict__["_spatial_label"] = cached  # plain attribute, not a parameter or buffer
    return cached[1]


def _placements(args, kwargs) -> list[str]:
    found = []
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, DTensor):
                found.append(f"{tuple(t.shape)} {tuple(t.placements)}")
    return found


def run_dtensor_op(func, args, kwargs):
    """``func(*args, **kwargs)``; a DTensor error becomes a ``SpatialShardingError``."""
    try:
        return func(*args, **kwargs)
    except SpatialShardingError:
        raise
    except (RuntimeError, NotImplementedError, AssertionError, ValueError) as exc:
        text = " ".join(str(exc).split())
        if not any(k.lower() in text.lower() for k in _DTENSOR_ERRORS):
            raise
        raise SpatialShardingError(
            f"{function_name(func)} in module '{module_path()}' is not supported on these "
            f"sharded inputs ({'; '.join(_placements(args, kwargs))}): DTensor has no local "
            f"rule for it ({text[:300]}). Use a supported op, make it "
            f"spatial (spconv_train.parallel.register_handler), or gather explicitly "
            f"(x.full_tensor())."
        ) from exc
