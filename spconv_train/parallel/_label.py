"""The name a spatial layer's errors carry, built once per module.

``module_label`` formats ``path (Type(extra_repr))`` on a module's first call and keeps it on
the module: a layer's hyperparameters are fixed once it is built, so formatting its
``extra_repr`` on every forward would be work repeated for nothing. The label is rebuilt only
when ``parallelize`` renames the module (its ``spatial_name``).
"""

from __future__ import annotations

from torch import nn

_KEY = "_spatial_label"


def torch_base(module: nn.Module) -> type:
    """The first ``torch.*`` class in the module's MRO (``Conv2d`` for ``SpatialConv2d``)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("torch."))


def module_label(module: nn.Module) -> str:
    """``"<spatial_name> (<TorchClass>(<extra_repr>))"`` of ``module``, cached on it."""
    name = getattr(module, "spatial_name", "") or "<module>"
    cached = module.__dict__.get(_KEY)
    if cached is None or cached[0] != name:
        cached = (name, f"{name} ({torch_base(module).__name__}({module.extra_repr()}))")
        module.__dict__[_KEY] = cached  # not a parameter or buffer: plain attribute storage
    return cached[1]
